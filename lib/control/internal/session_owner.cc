#include <refit/control/internal/session_owner.h>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

namespace refit::control::internal {

// The timer of one session's silence watch. Shared with its coroutine, which
// touches the owner only while `alive` (end_watch() clears it).
struct session_owner::watch_state {
  explicit watch_state(const asio::any_io_executor& ex) : timer(ex) {}
  asio::steady_timer timer;
  bool alive = true;
};

session_owner::session_owner(asio::any_io_executor loop, weight_update_session& session,
                             std::chrono::milliseconds timeout, std::function<std::size_t(std::uint64_t)> in_flight,
                             aborted_fn aborted)
    : loop_(std::move(loop)), session_(session), timeout_(timeout), in_flight_(std::move(in_flight)),
      aborted_(std::move(aborted)) {}

std::string session_owner::name() const {
  if (!owner_) return "nobody";
  return "connection #" + std::to_string(*owner_) + " (" + owner_peer_ + ")";
}

std::chrono::milliseconds session_owner::silence() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - owner_heard_);
}

bool session_owner::busy() const noexcept {
  if (session_.receiving()) return true;
  if (!owner_) return false;
  return in_flight_(*owner_) > 0;
}

void session_owner::opened_by(const rpc_connection& c) {
  owner_ = c.id;
  owner_peer_ = c.peer;
  owner_left_ = false;
  if (silenced_ == c.id) silenced_.reset();
  owner_heard_ = std::chrono::steady_clock::now();
  ++session_generation_;
  start_watch();
}

void session_owner::require(const rpc_connection& caller, const std::string& method) const {
  // A trainer that froze and resumed learns why its session is gone.
  const std::string silenced = silenced_ == caller.id
                                   ? " (this connection's weight update session was aborted: " + silenced_why_ + ")"
                                   : std::string();
  if (!session_.active())
    throw_error(errc::invalid_state, method + ": no active weight update (call start_weight_update first)" + silenced);
  if (owner_ != caller.id)
    throw_error(errc::invalid_state,
                method + ": the weight update session belongs to " + name() + ", not to " + caller.name() + silenced);
}

void session_owner::heard_from(const rpc_connection& c) noexcept {
  if (owner_ && *owner_ == c.id) owner_heard_ = std::chrono::steady_clock::now();
}

void session_owner::request_ended(const rpc_connection& c) noexcept {
  heard_from(c);  // the silence clock restarts when the owner's request ends
  if (!session_.active()) end_watch();
}

void session_owner::connection_closed(const rpc_connection& c) {
  if (silenced_ == c.id) silenced_.reset();
  if (!session_.active() || owner_ != c.id) return;
  // The trainer that owns the open session is gone: nobody may finish it.
  if (session_.receiving()) {
    owner_left_ = true;  // ended when its chunk ends (update_weights)
    return;
  }
  asio::co_spawn(loop_, end_after_owner_left(), asio::detached);
}

asio::awaitable<void> session_owner::end_after_owner_left() {
  const std::string who = name();
  owner_.reset();
  owner_left_ = false;
  if (!session_.active()) co_return;
  const std::string why = "its owner, " + who + ", closed its connection before finishing it";
  bool ended = false;
  try {
    co_await session_.abort_weight_update(why);
    ended = true;
  } catch (const error&) {
    // a chunk started meanwhile: its end decides
  }
  if (ended) {
    end_watch();
    // No verb failed: the host's last_error says what happened (and dirty_reason,
    // when an in_place chunk of it was applied; staged chunks were discarded).
    aborted_(why, errc::peer_lost);
  }
}

void session_owner::start_watch() {
  end_watch();
  watch_ = std::make_shared<watch_state>(loop_);
  asio::co_spawn(loop_, watch(watch_, session_generation_), asio::detached);
}

void session_owner::end_watch() noexcept {
  if (!watch_) return;
  watch_->alive = false;
  watch_->timer.cancel();
  watch_.reset();
}

asio::awaitable<void> session_owner::watch(std::shared_ptr<watch_state> w, std::uint64_t generation) {
  for (;;) {
    // The host may be gone: nothing of it is touched unless the watch is alive.
    if (!w->alive || !session_.active() || session_generation_ != generation) co_return;
    const auto now = std::chrono::steady_clock::now();
    // A chunk being received has its own deadlines, and a request of the owner's
    // still running is not silence; the clock restarts when they end.
    const bool is_busy = busy();
    const auto due = (is_busy ? now : owner_heard_) + timeout_;
    if (!is_busy && now >= due) {
      co_await abort_silent_session();
      co_return;
    }
    w->timer.expires_at(due);
    std::error_code ignored;
    co_await w->timer.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  }
}

asio::awaitable<void> session_owner::abort_silent_session() {
  const std::string why = "its owner, " + name() + ", sent nothing for " + std::to_string(silence().count()) +
                          " ms: no request, no data; the session timeout is " + std::to_string(timeout_.count()) +
                          " ms";
  const std::optional<std::uint64_t> owner = owner_;
  owner_.reset();
  owner_left_ = false;
  watch_.reset();  // this coroutine's own watch: it ends here
  try {
    co_await session_.abort_weight_update(why);
  } catch (const error&) {
    // a chunk started meanwhile (cannot happen: the owner was silent): its end decides
    owner_ = owner;
    co_return;
  }
  silenced_ = owner;
  silenced_why_ = why;
  aborted_(why, errc::timeout);
}

}  // namespace refit::control::internal
