// The UCP layer under the ucx engine (engines/ucx/ucp.h): a worker holds every
// request it tracks until the request's callback runs, and closing the worker
// ends the requests UCX drops without one (their waiters wake cancelled; nothing
// is left behind for LeakSanitizer to find).
#include <refit/engines/ucx/ucp.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <gtest/gtest.h>
#include <refit/error.h>

namespace refit::ucx {
namespace {

using namespace std::chrono_literals;

// UCX reads its settings when the first context is made.
const bool ucx_env = [] {
  setenv("UCX_TLS", "sm,self", 1);
  return true;
}();

struct rig {
  asio::io_context io;
  std::shared_ptr<context> ctx = std::make_shared<context>();
  std::shared_ptr<worker> w = worker::create(ctx, io.get_executor());
  std::array<std::byte, 64> buf{};
  std::optional<std::string> outcome;  // the wait's: "completed" or the error kind

  // Waits (5 s at most) on `r` in a coroutine on io; `outcome` says how it ended.
  void wait_on(tag_receive& r) {
    asio::co_spawn(
        io,
        [this, &r]() -> asio::awaitable<void> {
          try {
            co_await r.wait(5s);
            outcome = "completed";
          } catch (const error& e) {
            outcome = std::string(errc_name(e.kind()));
          }
        },
        asio::detached);
  }
  void run_until_outcome() {
    for (int i = 0; i < 200 && !outcome; ++i) io.run_for(10ms);
  }
};

TEST(ucp, a_receive_outstanding_when_its_worker_closes_wakes_cancelled_and_is_released) {
  rig t;
  std::vector<asio::mutable_buffer> dest{asio::buffer(t.buf)};
  tag_receive r(t.w, dest, 42, "a receive nobody sends");
  EXPECT_EQ(t.w->outstanding(), 1u);
  t.wait_on(r);
  t.io.run_for(50ms);
  ASSERT_FALSE(t.outcome) << "nothing was sent: " << *t.outcome;
  // UCX destroys the worker with the request outstanding and calls no callback:
  // the worker ends it itself.
  t.w->close();
  EXPECT_EQ(t.w->outstanding(), 0u);
  t.run_until_outcome();
  ASSERT_TRUE(t.outcome) << "the waiter never woke";
  EXPECT_EQ(*t.outcome, "cancelled");
}

TEST(ucp, a_receive_cancelled_while_its_worker_lives_ends_through_its_callback) {
  rig t;
  std::vector<asio::mutable_buffer> dest{asio::buffer(t.buf)};
  tag_receive r(t.w, dest, 42, "a receive nobody sends");
  worker::engaged busy(t.w);  // progress runs
  t.wait_on(r);
  t.io.run_for(20ms);
  r.cancel();
  t.run_until_outcome();
  ASSERT_TRUE(t.outcome) << "the waiter never woke";
  EXPECT_EQ(*t.outcome, "cancelled");
  EXPECT_EQ(t.w->outstanding(), 0u);
}

TEST(ucp, a_worker_closed_with_nothing_outstanding_and_closed_again_is_fine) {
  rig t;
  EXPECT_EQ(t.w->outstanding(), 0u);
  t.w->close();
  t.w->close();
  EXPECT_EQ(t.w->outstanding(), 0u);
}

// Memory is registered with its type: host memory always; memory on a CUDA device
// only where the UCX loaded has CUDA support, else refused (unsupported) before
// UCX sees the pointer, naming the device, UCX's version and what it handles.
TEST(ucp, registrations_say_their_memory_type_and_device_memory_needs_a_ucx_with_cuda) {
  auto ctx = std::make_shared<context>();
  EXPECT_TRUE(ctx->handles(refit::device::cpu()));
  EXPECT_NE(ctx->memory_types().find("host"), std::string::npos) << ctx->memory_types();
  const std::string version = context::version();  // "1.13.1"
  EXPECT_EQ(std::count(version.begin(), version.end(), '.'), 2) << version;
  std::vector<std::byte> host(4096);
  const registration on_host(ctx, host.data(), host.size(), refit::device::cpu());
  EXPECT_FALSE(on_host.packed_rkey().empty());
  if (ctx->handles(refit::device::cuda(0)))
    GTEST_SKIP() << "the UCX loaded (" << context::version() << ") handles " << ctx->memory_types()
                 << ": its device registrations are the GPU check's";
  try {
    registration on_device(ctx, host.data(), host.size(), refit::device::cuda(0));
    ADD_FAILURE() << "registered host memory as cuda:0 with a UCX that handles " << ctx->memory_types();
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported) << e.what();
    const std::string m = e.what();
    EXPECT_NE(m.find("cuda:0"), std::string::npos) << m;
    EXPECT_NE(m.find(context::version()), std::string::npos) << m;
    EXPECT_NE(m.find("host"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace refit::ucx
