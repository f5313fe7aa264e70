// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include <refit/engines/tcp/sharded.h>
#include <refit/engines/tcp/tcp.h>
#include <refit/factory.h>

namespace {
const refit::backend_type_registration<refit::tcp::engine, refit::tcp::sender> registration{"tcp"};
// M trainer ranks to N workers, each worker receiving only the bytes it keeps.
const refit::backend_type_registration<refit::tcp::sharded_engine, refit::tcp::sharded_sender> sharded{"tcp_sharded"};
}  // namespace
