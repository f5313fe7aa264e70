// The JSON type of refit's API: init infos, update infos, trainer arguments,
// statistics and control-plane messages are nlohmann::json values.
#pragma once

#include <nlohmann/json.hpp>

namespace refit {

using json = nlohmann::json;

}  // namespace refit
