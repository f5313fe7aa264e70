// Joins the process-wide factory; linked in through //engines:all (alwayslink) in
// builds but CUDA ones (.bazelrc), and by whatever depends on it directly.
#include <refit/engines/ucx/sharded.h>
#include <refit/engines/ucx/ucx.h>
#include <refit/factory.h>

namespace {
const refit::backend_type_registration<refit::ucx::engine, refit::ucx::sender> registration{"ucx"};
// M trainer ranks to N workers, each worker receiving only the bytes it keeps.
const refit::backend_type_registration<refit::ucx::sharded_engine, refit::ucx::sharded_sender> sharded{"ucx_sharded"};
}  // namespace
