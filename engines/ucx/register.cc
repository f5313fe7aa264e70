// Joins the process-wide factory; linked in through //engines:all (alwayslink) in
// builds but CUDA ones (.bazelrc), and by whatever depends on it directly.
#include <refit/engines/ucx/ucx.h>
#include <refit/factory.h>

namespace {
const refit::backend_type_registration<refit::ucx::engine, refit::ucx::sender> registration{"ucx"};
}  // namespace
