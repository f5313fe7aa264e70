// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include <refit/engines/tcp/tcp.h>
#include <refit/factory.h>

namespace {
const refit::backend_type_registration<refit::tcp::engine, refit::tcp::sender> registration{"tcp"};
}  // namespace
