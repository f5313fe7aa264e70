// Control frames: the input is what a peer writes on a control connection, a stream
// of [4-byte big-endian length][JSON] frames. Each frame goes through the same
// functions as frame_stream::read and the worker host's request handling, and the
// answer the host would send is built and serialized as frame_stream::write does.
#include <array>
#include <span>
#include <string>
#include <string_view>

#include <refit/control/internal/frame.h>
#include <refit/json_reader.h>
#include "tests/fuzz/fuzz.h"

namespace refit::fuzz {
namespace {

// Small enough that libFuzzer's inputs reach it; the check is the same at 256 MiB.
constexpr std::uint32_t max_frame = 2048;

// As worker_host::handle answers: the result or the error, naming the request id.
std::string answer_text(const json& id, const json* result, const error* failure) {
  json answer = json::object();
  answer["id"] = id;
  if (result) {
    answer["result"] = *result;
  } else {
    answer["error"] = {{"kind", errc_name(failure->kind())}, {"message", failure->message()}};
  }
  return answer.dump();  // throws (a bug) if a message is not valid UTF-8
}

bool run(std::span<const std::uint8_t> in) {
  bool all_ok = true;
  std::size_t frames = 0;
  while (!in.empty()) {
    if (in.size() < 4) return false;  // the peer closed mid-prefix: an I/O error, not a frame
    std::uint32_t len = 0;
    if (!expect("decode_frame_length", {errc::protocol_error},
                [&] { len = control::decode_frame_length(in.first<4>(), max_frame, "control request"); })) {
      return false;  // the connection is dropped: nothing after this frame is read
    }
    check(len <= max_frame, "decode_frame_length", "accepted a frame over the limit");
    in = in.subspan(4);
    if (in.size() < len) return false;  // closed mid-frame
    const std::string_view text(reinterpret_cast<const char*>(in.data()), len);
    in = in.subspan(len);
    ++frames;

    json message;
    if (!expect("parse_frame_body", {errc::protocol_error},
                [&] { message = control::parse_frame_body(text, "control request"); }))
      return false;  // a malformed frame ends the connection
    // What arrives is what was sent: a peer's serialization of it reads back equal.
    const std::string again = message.dump();
    json reread;
    check(expect("parse_frame_body (again)", {}, [&] { reread = control::parse_frame_body(again, "again"); }),
          "parse_frame_body", "a parsed frame's own serialization was refused");
    check(reread == message, "parse_frame_body", "dump/parse does not round-trip");

    // A bad request is answered with an error, and the connection carries on.
    json id = nullptr;
    control::control_request request;
    try {
      request = control::parse_request(json(message), id);
      check(id == json(request.id), "parse_request", "the id read is not the id reported");
      (void)answer_text(id, &request.params, nullptr);
    } catch (const error& e) {
      check(e.kind() == errc::invalid_argument, "parse_request", "a refit::error other than invalid_argument");
      all_ok = false;
      expect("error answer", {}, [&] { (void)answer_text(id, nullptr, &e); });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "refit fuzz: BUG in parse_request: %s: %s\n", typeid(e).name(), e.what());
      std::abort();
    }
  }
  return all_ok && frames > 0;
}

}  // namespace
}  // namespace refit::fuzz

bool refit_fuzz_one(const std::uint8_t* data, std::size_t size) {
  return refit::fuzz::run(std::span<const std::uint8_t>(data, size));
}
