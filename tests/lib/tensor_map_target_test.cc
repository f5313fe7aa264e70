// tensor_map_target: the ready-made model target. Its checks (refused updates
// leave the bytes alone), direct receive into its own memory, full updates through
// the loopback engine (both commit modes), and the reader contract in both reader
// modes: every byte a reader sees belongs to the version it is shown, while
// updates run repeatedly on another thread. And a target on "device" memory (a
// tensor_memory that is host memory claiming to be cuda:0) going through the
// interface for allocation, loads and fingerprints.
#include <refit/model/tensor_map_target.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <asio/io_context.hpp>

#include <refit/engines/loopback/loopback.h>
#include <refit/integrity/fingerprint.h>
#include <refit/model/tensor_memory.h>
#include <refit/session.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using testing::spawn;

const reader_mode modes[] = {reader_mode::reader_lock, reader_mode::double_buffered};

// The model of these tests: a split tensor (larger than a 16 KiB bucket), a small
// one and an odd-sized one.
update_metadata model_layout() {
  update_metadata m;
  m.tensors.push_back({"layers.0.w", dtype::float32, {64, 128}});  // 32 KiB
  m.tensors.push_back({"layers.0.b", dtype::bfloat16, {100}});
  m.tensors.push_back({"embed", dtype::int32, {7, 3}});
  return m;
}

// Byte i of tensor t at weight version v: every byte depends on the version.
std::byte fill(std::int64_t v, std::size_t t, std::size_t i) {
  return static_cast<std::byte>((v * 13 + static_cast<std::int64_t>(t) * 101 + static_cast<std::int64_t>(i % 251)) &
                                0xff);
}

void fill_all(std::span<std::byte> bytes, std::int64_t v, std::size_t t) {
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = fill(v, t, i);
}

// First byte index of `bytes` that does not follow fill(v, t), or -1.
long first_mismatch(std::span<const std::byte> bytes, std::int64_t v, std::size_t t) {
  for (std::size_t i = 0; i < bytes.size(); ++i)
    if (bytes[i] != fill(v, t, i)) return static_cast<long>(i);
  return -1;
}

std::unique_ptr<tensor_map_target> make_target(reader_mode mode, std::int64_t initial_version = 0) {
  tensor_map_target_options o;
  o.mode = mode;
  o.initial_version = initial_version;
  auto target = std::make_unique<tensor_map_target>(o);
  const auto layout = model_layout();
  for (std::size_t t = 0; t < layout.tensors.size(); ++t) fill_all(target->add(layout.tensors[t]), initial_version, t);
  return target;
}

// Checks every tensor of `r` against version `v`.
void expect_version(const tensor_map_target::reader& r, std::int64_t v) {
  ASSERT_EQ(r.version(), v);
  std::size_t t = 0;
  for (auto view : r) {
    EXPECT_EQ(first_mismatch(view.bytes(), v, t), -1) << view.name << " at version " << v;
    ++t;
  }
  EXPECT_EQ(t, model_layout().tensors.size());
}

// The trainer's copy of the model at version v.
struct trainer_copy {
  update_metadata meta;
  std::vector<std::vector<std::byte>> data;
  explicit trainer_copy(update_metadata m) : meta(std::move(m)) {
    for (const auto& s : meta.tensors) data.emplace_back(s.nbytes());
  }
  void set_version(std::int64_t v) {
    const auto layout = model_layout();
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
      std::size_t t = 0;
      while (layout.tensors[t].name != meta.tensors[i].name) ++t;
      fill_all(data[i], v, t);
    }
  }
  std::vector<tensor_view> views() {
    std::vector<tensor_view> out;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) out.emplace_back(meta.tensors[i], data[i].data());
    return out;
  }
};

// A loopback trainer and worker on one io_context, the worker's model the target.
struct loopback_pair {
  asio::io_context io;
  std::unique_ptr<loopback::sender> sender;
  std::unique_ptr<loopback::engine> engine;

  explicit loopback_pair(model_target* model) {
    static std::atomic<int> counter{0};
    weight_transfer_config config;
    config.backend = "loopback";
    config.timeout = std::chrono::seconds(20);
    engine_context ectx;
    ectx.executor = io.get_executor();
    ectx.model = model;
    trainer_context tctx;
    tctx.executor = io.get_executor();
    sender = std::make_unique<loopback::sender>(config, tctx);
    engine = std::make_unique<loopback::engine>(config, ectx);
    json args = {{"channel", "tensor-map-target-test-" + std::to_string(counter++)},
                 {"buffer_bytes", 16 << 10},
                 {"num_buffers", 2}};
    testing::run_to_completion(io, sender->init(args));
    auto info = engine->parse_init_info(args);
    testing::run_to_completion(io, engine->init_transfer_engine(*info));
  }

  std::unique_ptr<update_info> info_for(const update_metadata& meta, commit_mode commit) {
    json j = json::object();
    write_update_metadata(meta, j);
    std::unique_ptr<update_info> info = engine->parse_update_info(j);
    info->commit = commit;
    return info;
  }

  // One update of `copy` (at its version) into `load`; rethrows the worker's error.
  void update(trainer_copy& copy, load_weights_fn load, commit_mode commit = commit_mode::in_place) {
    auto received = spawn(io, testing::receive_update(*engine, info_for(copy.meta, commit), std::move(load)));
    auto sent = spawn(io, testing::send_views(*sender, copy.meta, copy.views()));
    ASSERT_TRUE(testing::run_until(io, [&] { return sent->done && received->done; })) << "update hung";
    ASSERT_FALSE(sent->error) << sent->message();
    if (received->error) std::rethrow_exception(received->error);
  }
};

// ---------------------------------------------------------------- populating

TEST(tensor_map_target, add_owns_or_wraps_memory_and_checks_it) {
  tensor_map_target target;
  auto owned = target.add({"a", dtype::float32, {4, 4}});
  EXPECT_EQ(owned.size(), 64u);
  for (auto b : owned) EXPECT_EQ(b, std::byte{0}) << "owned memory starts zeroed";
  std::vector<std::byte> mine(6);
  auto wrapped = target.add({"b", dtype::bfloat16, {3}}, mine);
  EXPECT_EQ(wrapped.data(), mine.data());

  std::vector<std::byte> small(5);
  auto e = REFIT_THROWN(target.add({"c", dtype::bfloat16, {3}}, small));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("external memory for 'c' is 5 bytes"));
  EXPECT_THAT(e.message(), HasSubstr("needs 6"));
  e = REFIT_THROWN(target.add({"a", dtype::float32, {1}}));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'a' was already added"));

  // The application's memory is where readers read and where updates land.
  auto d = target.destination({"b", dtype::bfloat16, {3}});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->data, mine.data());
  EXPECT_EQ(target.read().view("b").data, mine.data());
  e = REFIT_THROWN(target.add({"late", dtype::float32, {1}}));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_EQ(target.read().size(), 2u);
}

// ---------------------------------------------------------------- checks

TEST(tensor_map_target, begin_update_names_the_tensor_and_what_differs) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode);
    update_metadata unknown = model_layout();
    unknown.tensors.push_back({"layers.9.w", dtype::float32, {2}});
    auto e = REFIT_THROWN(target->begin_update(unknown));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.9.w' is not a tensor of this model"));

    update_metadata wrong_dtype = model_layout();
    wrong_dtype.tensors[1].dtype = dtype::float16;
    e = REFIT_THROWN(target->begin_update(wrong_dtype));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.b' has dtype float16, the model's is bfloat16"));

    update_metadata wrong_shape = model_layout();
    wrong_shape.tensors[0].shape = {128, 64};
    e = REFIT_THROWN(target->begin_update(wrong_shape));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.w' has shape [128, 64], the model's is [64, 128]"));

    // No destination for a tensor that does not match exactly.
    EXPECT_FALSE(target->destination(wrong_shape.tensors[0]));
    EXPECT_FALSE(target->destination(unknown.tensors.back()));
    EXPECT_NO_THROW(target->begin_update(model_layout()));
  }
}

TEST(tensor_map_target, a_refused_update_moves_no_byte_through_the_engine) {
  for (reader_mode mode : modes) {
    for (commit_mode commit : {commit_mode::in_place, commit_mode::staged}) {
      SCOPED_TRACE(std::string(to_string(mode)) + " " + std::string(to_string(commit)));
      auto target = make_target(mode, 1);
      loopback_pair pair(target.get());
      update_metadata bad = model_layout();
      bad.tensors[2].shape = {3, 7};
      int loads = 0;
      auto received = spawn(pair.io, testing::receive_update(*pair.engine, pair.info_for(bad, commit),
                                                             [&](std::span<const tensor_view> w) {
                                                               ++loads;
                                                               target->load_weights(w);
                                                             }));
      ASSERT_TRUE(testing::run_until(pair.io, [&] { return received->done; }));
      ASSERT_TRUE(received->error) << "the update must be refused";
      EXPECT_EQ(received->kind(), static_cast<int>(errc::invalid_argument));
      EXPECT_THAT(received->message(), HasSubstr("tensor 'embed' has shape [3, 7], the model's is [7, 3]"));
      EXPECT_EQ(loads, 0);
      EXPECT_FALSE(target->writing()) << "no byte may have landed";
      target->abort("refused");  // what the worker host does after a failed chunk
      EXPECT_FALSE(target->dirty()) << "an update refused before its first byte changes nothing";
      EXPECT_FALSE(pair.engine->weights_dirty());
      expect_version(target->read(), 1);
    }
  }
}

TEST(tensor_map_target, load_weights_checks_the_whole_batch_before_writing) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode, 3);
    trainer_copy copy(model_layout());
    copy.set_version(4);
    auto views = copy.views();
    std::vector<std::int64_t> wrong = {5};
    views[2].shape = wrong;  // the last of the batch is wrong: nothing of it is written
    auto e = REFIT_THROWN(target->load_weights(views));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'embed' with shape [5], the model's is [7, 3]"));
    EXPECT_FALSE(target->writing());
    EXPECT_TRUE(target->try_read()) << "a refused batch takes no lock";
    expect_version(target->read(), 3);

    tensor_view on_gpu("layers.0.b", dtype::bfloat16, std::span<const std::int64_t>(copy.meta.tensors[1].shape),
                       copy.data[1].data(), device::cuda(0));
    e = REFIT_THROWN(target->load_weights(std::span<const tensor_view>(&on_gpu, 1)));
    EXPECT_EQ(e.kind(), errc::unsupported);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.b' on cuda:0; this target's tensors are on cpu"));
  }
}

// ---------------------------------------------------------------- receiving

TEST(tensor_map_target, destination_is_the_targets_own_memory) {
  // reader_lock: the one copy; double_buffered: the back copy, served after finish.
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode, 0);
    std::vector<const std::byte*> front;
    for (auto v : target->read()) front.push_back(v.data);
    loopback_pair pair(target.get());
    trainer_copy copy(model_layout());
    copy.set_version(1);
    std::vector<const std::byte*> loaded(copy.meta.tensors.size(), nullptr);
    std::vector<const std::byte*> offered;
    for (const auto& s : copy.meta.tensors) offered.push_back(target->destination(s)->data);
    pair.update(copy, [&](std::span<const tensor_view> w) {
      for (const auto& v : w)
        for (std::size_t t = 0; t < copy.meta.tensors.size(); ++t)
          if (copy.meta.tensors[t].name == v.name) loaded[t] = v.data;
      target->load_weights(w);
    });
    target->finish(1);
    auto r = target->read();
    expect_version(r, 1);
    for (std::size_t t = 0; t < loaded.size(); ++t) {
      EXPECT_EQ(loaded[t], offered[t]) << copy.meta.tensors[t].name << ": not received into the target's memory";
      EXPECT_EQ(r[t].data, offered[t]) << "served from the memory it was received into";
      if (mode == reader_mode::reader_lock)
        EXPECT_EQ(offered[t], front[t]) << "one copy";
      else
        EXPECT_NE(offered[t], front[t]) << "received into the back copy, not under the readers";
    }
  }
}

TEST(tensor_map_target, full_and_partial_updates_through_the_loopback_engine) {
  for (reader_mode mode : modes) {
    for (commit_mode commit : {commit_mode::in_place, commit_mode::staged}) {
      SCOPED_TRACE(std::string(to_string(mode)) + " " + std::string(to_string(commit)));
      auto target = make_target(mode, 0);
      loopback_pair pair(target.get());
      trainer_copy copy(model_layout());
      copy.set_version(5);
      pair.update(copy, target->as_load_weights(), commit);
      EXPECT_FALSE(target->try_read() && mode == reader_mode::reader_lock)
          << "between the last byte and finish the update holds the lock";
      target->finish(5);
      EXPECT_FALSE(target->updating());
      EXPECT_EQ(target->version(), 5);
      EXPECT_EQ(target->generation(), 1u);
      expect_version(target->read(), 5);
      EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views()));

      // An update of one tensor: the others keep their bytes (in double_buffered
      // mode they are served from the copy they were in).
      update_metadata one;
      one.tensors.push_back(model_layout().tensors[0]);
      trainer_copy part(one);
      part.set_version(6);
      pair.update(part, target->as_load_weights(), commit);
      target->finish(6);
      auto r = target->read();
      EXPECT_EQ(r.version(), 6);
      EXPECT_EQ(first_mismatch(r.view("layers.0.w").bytes(), 6, 0), -1);
      EXPECT_EQ(first_mismatch(r.view("layers.0.b").bytes(), 5, 1), -1);
      EXPECT_EQ(first_mismatch(r.view("embed").bytes(), 5, 2), -1);
      r.release();
      // And the next full update after a partial one.
      copy.set_version(7);
      pair.update(copy, target->as_load_weights(), commit);
      target->finish(7);
      expect_version(target->read(), 7);
    }
  }
}

// A fleet-atomic session (undoable, staged) over a reader_lock target: a chunk
// whose load_weights is the target's own is committed by exchange (the stage then
// holds the previous bytes), another chunk's (an application loader) by read back
// and load. When that loader throws, both chunks' tensors are back at the
// previous version; the next commit exchanges every chunk, and its rollback
// returns every byte.
asio::awaitable<void> receive_in(weight_update_session& s, std::unique_ptr<update_info> info, load_weights_fn load) {
  co_await s.update_weights(*info, std::move(load));
}

TEST(tensor_map_target, fleet_atomic_commits_exchange_with_the_stage_and_roll_back) {
  auto target = make_target(reader_mode::reader_lock, 0);
  ASSERT_TRUE(target->can_exchange());
  loopback_pair pair(target.get());
  trainer_copy copy(model_layout());
  copy.set_version(5);
  pair.update(copy, target->as_load_weights(), commit_mode::staged);
  target->finish(5);
  weight_update_session session(*pair.engine);
  auto run = [&](auto make) {
    auto done = spawn(pair.io, make());
    EXPECT_TRUE(testing::run_until(pair.io, [&] { return done->done; })) << "hung";
    return done->error;
  };
  // One chunk per tensor; tensor 2's through `other`.
  auto stage = [&](std::int64_t version, load_weights_fn other) {
    session.start_weight_update();
    session.require_undo();
    copy.set_version(version);
    auto views = copy.views();
    for (std::size_t t = 0; t < views.size(); ++t) {
      update_metadata one;
      one.tensors.push_back(copy.meta.tensors[t]);
      load_weights_fn load = t == 2 && other ? other : target->as_load_weights();
      auto got = spawn(pair.io, receive_in(session, pair.info_for(one, commit_mode::staged), std::move(load)));
      auto sent = spawn(pair.io, testing::send_views(*pair.sender, one, {views[t]}));
      ASSERT_TRUE(testing::run_until(pair.io, [&] { return got->done && sent->done; }));
      ASSERT_FALSE(got->error) << got->message();
    }
    ASSERT_FALSE(run([&] { return session.prepare_weight_update(); }));
  };

  bool fail = true;
  stage(6, [&](std::span<const tensor_view> w) {
    if (std::exchange(fail, false)) throw_error(errc::processing_failed, "the loader failed");
    target->load_weights(w);
  });
  auto failed = run([&] { return session.finish_weight_update(6); });
  ASSERT_TRUE(failed);
  EXPECT_THAT(describe_error(failed), HasSubstr("the loader failed"));
  EXPECT_FALSE(pair.engine->weights_dirty()) << pair.engine->dirty_reason();
  target->finish(5);  // what control::tensor_map_hooks does: the engine is clean
  expect_version(target->read(), 5);

  stage(7, nullptr);
  ASSERT_FALSE(run([&] { return session.finish_weight_update(7); }));
  target->finish(7);
  expect_version(target->read(), 7);
  ASSERT_TRUE(session.holds_undo());
  ASSERT_FALSE(run([&] { return session.rollback_weight_update(); }));
  target->finish(5);
  expect_version(target->read(), 5);
  EXPECT_FALSE(pair.engine->weights_dirty());

  // double_buffered loads its back copies: no exchange, read back instead.
  EXPECT_FALSE(make_target(reader_mode::double_buffered)->can_exchange());
}

// ---------------------------------------------------------------- readers

TEST(tensor_map_target, try_read_is_refused_while_an_update_holds_the_lock) {
  auto target = make_target(reader_mode::reader_lock, 0);
  target->begin_update(model_layout());
  EXPECT_TRUE(target->try_read()) << "announced, but no byte has landed yet";
  target->direct_write_begins();
  EXPECT_TRUE(target->writing());
  EXPECT_FALSE(target->try_read());
  auto e = REFIT_THROWN(target->fingerprint({}));
  EXPECT_EQ(e.kind(), errc::invalid_state);

  // A blocked read() sees the new version with its bytes, once finished.
  std::promise<void> got_promise;
  std::future<void> got = got_promise.get_future();
  std::optional<std::int64_t> seen;
  std::thread reader([&] {
    auto r = target->read();
    seen = r.version();
    got_promise.set_value();
  });
  // The read's completion, awaited for 100 ms: it must not come while the lock is held.
  EXPECT_EQ(got.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "read() must wait while the update holds the lock";
  for (std::size_t t = 0; t < model_layout().tensors.size(); ++t)
    fill_all(target->destination(model_layout().tensors[t])->bytes(), 1, t);
  target->finish(1);
  reader.join();
  EXPECT_EQ(seen, 1);
  expect_version(*target->try_read(), 1);

  // double_buffered: never refused.
  auto db = make_target(reader_mode::double_buffered, 0);
  db->begin_update(model_layout());
  db->direct_write_begins();
  EXPECT_TRUE(db->writing());
  auto r = db->try_read();
  ASSERT_TRUE(r);
  expect_version(*r, 0);
  EXPECT_NO_THROW(db->fingerprint({}));
}

TEST(tensor_map_target, abort_dirties_reader_lock_and_discards_double_buffered) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode, 2);
    // An abort before any byte changes nothing.
    target->begin_update(model_layout());
    target->abort("refused by the trainer");
    EXPECT_FALSE(target->dirty());
    EXPECT_EQ(target->generation(), 0u);

    // Half an update lands, then it is aborted.
    target->begin_update(model_layout());
    auto spec = model_layout().tensors[0];
    auto d = target->destination(spec);
    ASSERT_TRUE(d);
    target->direct_write_begins();
    std::memset(d->data, 0xEE, d->nbytes() / 2);
    trainer_copy copy(model_layout());
    copy.set_version(3);
    auto views = copy.views();
    target->load_weights(std::span<const tensor_view>(views.data() + 1, 1));
    target->abort("the trainer's connection was lost");
    EXPECT_FALSE(target->updating());
    auto r = target->try_read();
    ASSERT_TRUE(r) << "an abort releases the lock";
    if (mode == reader_mode::reader_lock) {
      EXPECT_TRUE(r->dirty());
      EXPECT_TRUE(target->dirty());
      EXPECT_EQ(r->version(), std::nullopt) << "dirty bytes are no version";
      EXPECT_THAT(r->dirty_reason(), HasSubstr("aborted after it had started writing the weights"));
      EXPECT_THAT(r->dirty_reason(), HasSubstr("version 2"));
      EXPECT_THAT(r->dirty_reason(), HasSubstr("the trainer's connection was lost"));
      EXPECT_EQ(r->generation(), 1u);
    } else {
      EXPECT_FALSE(r->dirty());
      EXPECT_EQ(r->generation(), 0u);
      expect_version(*r, 2);  // the front never saw the aborted update
    }
    r->release();

    // The next finished update is clean (and in double_buffered mode, whatever the
    // aborted one left in the back copy is overwritten).
    target->begin_update(model_layout());
    target->load_weights(views);
    target->finish(3);
    EXPECT_FALSE(target->dirty());
    EXPECT_EQ(target->dirty_reason(), "");
    expect_version(target->read(), 3);
  }
}

TEST(tensor_map_target, finish_while_load_weights_runs_is_refused) {
  // A load_weights blocked behind a held guard (reader_lock) is still running.
  auto target = make_target(reader_mode::reader_lock, 0);
  trainer_copy copy(model_layout());
  copy.set_version(1);
  auto views = copy.views();
  auto guard = target->read();
  std::thread loader([&] { target->load_weights(views); });
  while (!target->updating()) std::this_thread::yield();
  // The loader waits for the guard: the update has not written yet, and it cannot
  // be finished or aborted under it.
  EXPECT_FALSE(target->writing());
  auto e = REFIT_THROWN(target->finish(1));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_THAT(e.message(), HasSubstr("load_weights of the update is still running"));
  e = REFIT_THROWN(target->abort("no"));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  expect_version(guard, 0);
  guard.release();
  loader.join();
  EXPECT_TRUE(target->writing());
  target->finish(1);
  expect_version(target->read(), 1);
}

// Several reader threads check, in a loop, that every byte they read is of the
// version they are shown, while the worker receives update after update through
// the loopback engine (direct receive, both commit modes).
TEST(tensor_map_target, concurrent_readers_never_see_bytes_of_another_version) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode, 0);
    loopback_pair pair(target.get());
    std::atomic<bool> stop{false};
    std::atomic<long> reads{0}, mismatches{0}, missing_versions{0};
    std::atomic<std::int64_t> max_seen{0};
    std::vector<std::thread> readers;
    for (int k = 0; k < 3; ++k) {
      readers.emplace_back([&] {
        while (!stop) {
          auto r = target->read();
          if (!r.version()) {
            ++missing_versions;
            continue;
          }
          const std::int64_t v = *r.version();
          std::size_t t = 0;
          for (auto view : r) {
            if (first_mismatch(view.bytes(), v, t) != -1) ++mismatches;
            ++t;
          }
          std::int64_t m = max_seen;
          while (v > m && !max_seen.compare_exchange_weak(m, v)) {
          }
          ++reads;
        }
      });
    }
    trainer_copy copy(model_layout());
    constexpr int updates = 40;
    for (int v = 1; v <= updates; ++v) {
      copy.set_version(v);
      pair.update(copy, target->as_load_weights(), v % 2 ? commit_mode::in_place : commit_mode::staged);
      target->finish(v);
      // Let readers in between updates now and then.
      if (v % 8 == 0)
        for (long seen = reads; reads == seen && v < updates;) std::this_thread::yield();
    }
    stop = true;
    for (auto& t : readers) t.join();
    EXPECT_EQ(mismatches, 0) << "a reader saw bytes that are not of the version it was shown";
    EXPECT_EQ(missing_versions, 0);
    EXPECT_GT(reads, 0);
    EXPECT_GT(max_seen, 0) << "readers saw updates";
    expect_version(target->read(), updates);
  }
}

// double_buffered: a guard of an old generation keeps its bytes even across the
// next update; that update's first write waits until the guard is released.
TEST(tensor_map_target, double_buffered_guards_keep_their_generation) {
  auto target = make_target(reader_mode::double_buffered, 0);
  trainer_copy copy(model_layout());
  copy.set_version(1);
  auto v1 = copy.views();
  target->load_weights(v1);
  auto old = target->read();  // taken during the update: generation 0
  target->finish(1);
  expect_version(old, 0);  // after the swap too
  expect_version(target->read(), 1);

  copy.set_version(2);
  auto v2 = copy.views();
  std::promise<void> written_promise;
  std::future<void> written = written_promise.get_future();
  std::thread loader([&] {
    target->load_weights(v2);  // into the copy `old` still reads
    written_promise.set_value();
  });
  // The load's completion, awaited for 100 ms: it must not come while the guard lives.
  EXPECT_EQ(written.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "the update must wait for the guard of generation 0";
  expect_version(old, 0);
  expect_version(target->read(), 1);  // current readers are never blocked
  old.release();
  loader.join();
  target->finish(2);
  expect_version(target->read(), 2);
}

// ---------------------------------------------------------------- device memory

// Host memory that claims to be on a device (cuda:0 by default) and counts what
// the target asks of it: the core's side of device tensors, without a GPU.
class counting_memory final : public tensor_memory {
 public:
  explicit counting_memory(refit::device dev = device::cuda(0)) : dev_(dev) {}
  refit::device device() const noexcept override { return dev_; }
  std::byte* allocate_zeroed(std::uint64_t bytes) override {
    ++allocations;
    return host_.allocate_zeroed(bytes);
  }
  void release(std::byte* p) noexcept override {
    ++releases;
    host_.release(p);
  }
  void copy_in(std::byte* dst, const tensor_view& src) override {
    ++copies_in;
    if (src.device.is_cpu())
      ++from_host;
    else if (src.device == dev_)
      ++from_device;
    else
      ++from_elsewhere;
    if (src.nbytes() != 0) std::memcpy(dst, src.data, static_cast<std::size_t>(src.nbytes()));
  }
  void copy_out(std::span<std::byte> host, const std::byte* src) override {
    ++copies_out;
    if (!host.empty()) std::memcpy(host.data(), src, host.size());
  }

  std::atomic<int> allocations{0}, releases{0}, copies_in{0}, copies_out{0};
  std::atomic<int> from_host{0}, from_device{0}, from_elsewhere{0};

 private:
  refit::device dev_;
  host_tensor_memory host_;
};

std::unique_ptr<tensor_map_target> make_device_target(reader_mode mode, std::shared_ptr<counting_memory> memory,
                                                      std::int64_t initial_version = 0,
                                                      bool direct_receive_on_device = false) {
  tensor_map_target_options o;
  o.mode = mode;
  o.initial_version = initial_version;
  o.memory = memory;
  o.direct_receive_on_device = direct_receive_on_device;
  auto target = std::make_unique<tensor_map_target>(o);
  const auto layout = model_layout();
  for (std::size_t t = 0; t < layout.tensors.size(); ++t) {
    // The initial weights, written the way an application writes device memory.
    std::vector<std::byte> host(layout.tensors[t].nbytes());
    fill_all(host, initial_version, t);
    auto at = target->add(layout.tensors[t]);
    memory->copy_in(at.data(), tensor_view(layout.tensors[t], host.data()));
  }
  memory->copies_in = 0;
  memory->from_host = 0;
  return target;
}

// Every tensor of `target` read back through the memory's copy_out.
void expect_device_version(tensor_map_target& target, tensor_memory& memory, std::int64_t v) {
  auto r = target.read();
  ASSERT_EQ(r.version(), v);
  std::size_t t = 0;
  for (auto view : r) {
    EXPECT_EQ(view.device, device::cuda(0)) << view.name;
    std::vector<std::byte> host(view.nbytes());
    memory.copy_out(host, view.data);
    EXPECT_EQ(first_mismatch(host, v, t), -1) << view.name << " at version " << v;
    ++t;
  }
  EXPECT_EQ(t, model_layout().tensors.size());
}

TEST(tensor_map_target, device_memory_allocates_through_the_interface_and_views_carry_its_device) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    const int copies = mode == reader_mode::double_buffered ? 2 : 1;
    auto memory = std::make_shared<counting_memory>();
    auto target = make_device_target(mode, memory, 0);
    EXPECT_EQ(memory->allocations, 3 * copies);
    EXPECT_EQ(target->device(), device::cuda(0));
    EXPECT_EQ(target->memory().get(), memory.get());

    // The application's memory: a view on the memory's device, not a host span.
    std::vector<std::byte> mine(8);
    auto e = REFIT_THROWN(target->add({"span", dtype::float32, {2}}, mine));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("'span'"));
    EXPECT_THAT(e.message(), HasSubstr("on cuda:0"));
    const std::vector<std::int64_t> two = {2};
    e = REFIT_THROWN(target->add(tensor_view("on_host", dtype::float32, two, mine.data())));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("external memory for 'on_host' is on cpu, this target's tensors are on cuda:0"));
    auto wrapped = target->add(tensor_view("mine", dtype::float32, two, mine.data(), device::cuda(0)));
    EXPECT_EQ(wrapped.data, mine.data());
    EXPECT_EQ(wrapped.device, device::cuda(0));
    EXPECT_EQ(wrapped.name, "mine");
    EXPECT_EQ(memory->allocations, 3 * copies + (copies - 1)) << "double_buffered: the other copy is allocated";

    // Device memory is no destination unless the engine receives on that device.
    for (const auto& s : model_layout().tensors) EXPECT_FALSE(target->destination(s)) << s.name;
    auto r = target->read();
    for (auto v : r) EXPECT_EQ(v.device, device::cuda(0)) << v.name;
    EXPECT_EQ(r.view("mine").data, mine.data());
    r.release();

    auto direct = make_device_target(mode, memory, 0, true);
    auto d = direct->destination(model_layout().tensors[0]);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->device, device::cuda(0));
    tensor_map_target_options off;
    off.memory = memory;
    off.direct_receive = false;
    off.direct_receive_on_device = true;
    tensor_map_target none(off);
    none.add(model_layout().tensors[0]);
    EXPECT_FALSE(none.destination(model_layout().tensors[0])) << "direct_receive = false wins";

    const int allocated = memory->allocations;
    target.reset();
    direct.reset();
    EXPECT_EQ(memory->releases, allocated - 1) << "every owned copy is released (not the one of `none`, reader_lock)";
  }
}

TEST(tensor_map_target, device_memory_full_update_through_the_loopback_engine) {
  for (reader_mode mode : modes) {
    for (commit_mode commit : {commit_mode::in_place, commit_mode::staged}) {
      SCOPED_TRACE(std::string(to_string(mode)) + " " + std::string(to_string(commit)));
      auto memory = std::make_shared<counting_memory>();
      auto target = make_device_target(mode, memory, 0);
      loopback_pair pair(target.get());  // receives on the host: staged, then copied in
      trainer_copy copy(model_layout());
      copy.set_version(5);
      pair.update(copy, target->as_load_weights(), commit);
      target->finish(5);
      EXPECT_EQ(memory->copies_in, 3) << "every tensor goes through copy_in";
      EXPECT_EQ(memory->from_host, 3) << "from the engine's host staging";
      expect_device_version(*target, *memory, 5);

      memory->copies_out = 0;
      EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views())) << "the trainer's fingerprints";
      EXPECT_EQ(memory->copies_out, 3) << "fingerprints hash host copies";
      const std::vector<std::string> names = {"embed", "layers.0.w"};
      EXPECT_EQ(target->fingerprint(names), fingerprint_all(copy.views(), names));
      auto e = REFIT_THROWN(target->fingerprint({"nope"}));
      EXPECT_EQ(e.kind(), errc::invalid_argument);
      EXPECT_THAT(e.message(), HasSubstr("'nope'"));

      // A partial update; then views already on the device (device -> device).
      update_metadata one;
      one.tensors.push_back(model_layout().tensors[0]);
      trainer_copy part(one);
      part.set_version(6);
      pair.update(part, target->as_load_weights(), commit);
      target->finish(6);
      {
        auto r = target->read();
        std::vector<std::byte> host(r.view("layers.0.w").nbytes());
        memory->copy_out(host, r.view("layers.0.w").data);
        EXPECT_EQ(first_mismatch(host, 6, 0), -1);
        host.resize(r.view("embed").nbytes());
        memory->copy_out(host, r.view("embed").data);
        EXPECT_EQ(first_mismatch(host, 5, 2), -1);
      }
      copy.set_version(7);
      std::vector<tensor_view> on_device = copy.views();
      for (auto& v : on_device) v.device = device::cuda(0);
      target->load_weights(on_device);
      target->finish(7);
      EXPECT_EQ(memory->from_device, 3);
      expect_device_version(*target, *memory, 7);
      EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views()));
    }
  }
}

TEST(tensor_map_target, device_memory_refuses_views_on_other_devices_naming_the_tensor) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto memory = std::make_shared<counting_memory>();
    auto target = make_device_target(mode, memory, 3);
    trainer_copy copy(model_layout());
    copy.set_version(4);
    auto views = copy.views();
    views[1].device = device::cuda(1);  // the others are fine: nothing of the batch is written
    auto e = REFIT_THROWN(target->load_weights(views));
    EXPECT_EQ(e.kind(), errc::unsupported);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.b' on cuda:1"));
    EXPECT_THAT(e.message(), HasSubstr("this target's tensors are on cuda:0"));
    EXPECT_THAT(e.message(), HasSubstr("nothing of the batch was written"));
    EXPECT_EQ(memory->copies_in, 0);
    EXPECT_FALSE(target->writing());
    expect_device_version(*target, *memory, 3);
  }
}

// With direct_receive_on_device the target offers device memory; an engine that
// receives on the host refuses it (why it is off by default).
TEST(tensor_map_target, device_destinations_are_refused_by_a_host_engine) {
  auto memory = std::make_shared<counting_memory>();
  auto target = make_device_target(reader_mode::reader_lock, memory, 0, true);
  loopback_pair pair(target.get());
  trainer_copy copy(model_layout());
  copy.set_version(1);
  auto received = spawn(pair.io, testing::receive_update(*pair.engine, pair.info_for(copy.meta, commit_mode::in_place),
                                                         target->as_load_weights()));
  ASSERT_TRUE(testing::run_until(pair.io, [&] { return received->done; }));
  ASSERT_TRUE(received->error);
  EXPECT_THAT(received->message(), HasSubstr("on cuda:0, expected"));
  EXPECT_FALSE(target->writing());
}

}  // namespace
}  // namespace refit
