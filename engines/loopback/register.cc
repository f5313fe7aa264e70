// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include <refit/engines/loopback/loopback.h>
#include <refit/factory.h>

namespace {
const refit::backend_type_registration<refit::loopback::engine, refit::loopback::sender> registration{"loopback"};
}  // namespace
