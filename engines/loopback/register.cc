// Joins the process-wide factory; linked in through //engines:all (alwayslink).
#include "engines/loopback/loopback.h"
#include "lib/factory.h"

namespace {
const refit::backend_registration registration{
    "loopback",
    [](const refit::weight_transfer_config& c, const refit::engine_context& x) {
      return std::unique_ptr<refit::weight_transfer_engine>(new refit::loopback::engine(c, x));
    },
    [](const refit::weight_transfer_config& c, const refit::trainer_context& x) {
      return std::unique_ptr<refit::weight_sender>(new refit::loopback::sender(c, x));
    }};
}  // namespace
