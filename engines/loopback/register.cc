// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include "engines/loopback/loopback.h"
#include "lib/factory.h"

namespace {
const refit::backend_type_registration<refit::loopback::engine, refit::loopback::sender> registration{"loopback"};
}  // namespace
