// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include "engines/tcp/tcp.h"
#include "lib/factory.h"

namespace {
const refit::backend_type_registration<refit::tcp::engine, refit::tcp::sender> registration{"tcp"};
}  // namespace
