#include <refit/model/tensor_map_target.h>

#include <algorithm>

#include <refit/error.h>

namespace refit {

std::string_view to_string(reader_mode mode) noexcept {
  switch (mode) {
    case reader_mode::reader_lock:
      return "reader_lock";
    case reader_mode::double_buffered:
      return "double_buffered";
  }
  return "unknown";
}

namespace {

constexpr const char* who = "tensor_map_target";

// "" when `spec` is the model's tensor, else what differs.
std::string mismatch(const tensor_spec& model, dtype type, std::span<const std::int64_t> shape) {
  if (type != model.dtype)
    return "dtype " + std::string(to_string(type)) + ", the model's is " + std::string(to_string(model.dtype));
  if (!std::equal(shape.begin(), shape.end(), model.shape.begin(), model.shape.end()))
    return "shape " + shape_to_string(shape) + ", the model's is " + shape_to_string(model.shape);
  return {};
}

}  // namespace

// What readers are shown: one generation of the weights.
struct tensor_map_target::snapshot {
  std::uint64_t generation = 0;
  std::optional<std::int64_t> version;  // nullopt when dirty
  std::string dirty_reason;             // empty: clean
  std::vector<std::byte*> data;         // per tensor, the copy readers read
};

void tensor_map_target::memory_deleter::operator()(std::byte* p) const noexcept {
  if (p) memory->release(p);
}

// ---------------------------------------------------------------- reader

tensor_map_target::reader::reader(reader&& other) noexcept
    : target_(other.target_), snap_(std::move(other.snap_)), shared_lock_(other.shared_lock_) {
  other.target_ = nullptr;
  other.shared_lock_ = false;
}

tensor_map_target::reader& tensor_map_target::reader::operator=(reader&& other) noexcept {
  if (this != &other) {
    release();
    target_ = other.target_;
    snap_ = std::move(other.snap_);
    shared_lock_ = other.shared_lock_;
    other.target_ = nullptr;
    other.shared_lock_ = false;
  }
  return *this;
}

tensor_map_target::reader::~reader() { release(); }

void tensor_map_target::reader::release() noexcept {
  if (shared_lock_ && target_) target_->release_shared();
  shared_lock_ = false;
  snap_.reset();  // outside the target's mutex: the last reference locks it to count
  target_ = nullptr;
}

std::optional<std::int64_t> tensor_map_target::reader::version() const noexcept { return snap_->version; }
std::uint64_t tensor_map_target::reader::generation() const noexcept { return snap_->generation; }
bool tensor_map_target::reader::dirty() const noexcept { return !snap_->dirty_reason.empty(); }
const std::string& tensor_map_target::reader::dirty_reason() const noexcept { return snap_->dirty_reason; }
std::size_t tensor_map_target::reader::size() const noexcept { return snap_->data.size(); }

tensor_view tensor_map_target::reader::operator[](std::size_t index) const {
  if (index >= snap_->data.size())
    throw_error(errc::invalid_argument, std::string(who) + ": tensor index " + std::to_string(index) +
                                            " out of range (" + std::to_string(snap_->data.size()) + " tensors)");
  return tensor_view(target_->tensors_[index].spec, snap_->data[index], target_->device_);
}

std::optional<tensor_view> tensor_map_target::reader::find(std::string_view name) const {
  auto it = target_->index_.find(name);
  if (it == target_->index_.end()) return std::nullopt;
  return tensor_view(target_->tensors_[it->second].spec, snap_->data[it->second], target_->device_);
}

tensor_view tensor_map_target::reader::view(std::string_view name) const {
  if (auto v = find(name)) return *v;
  throw_error(errc::invalid_argument, std::string(who) + ": no tensor named '" + std::string(name) + "'");
}

// ---------------------------------------------------------------- setup

tensor_map_target::tensor_map_target(tensor_map_target_options options)
    : options_(std::move(options)), memory_(options_.memory ? options_.memory : host_memory()),
      device_(memory_->device()) {}

tensor_map_target::~tensor_map_target() {
  // Guards must not outlive the target; the target's own snapshot goes last.
  std::shared_ptr<const snapshot> last;
  {
    std::lock_guard lock(mutex_);
    last = std::move(current_);
  }
}

std::span<std::byte> tensor_map_target::add(const tensor_spec& spec) { return add_entry(spec, nullptr, 0, false); }

std::span<std::byte> tensor_map_target::add(const tensor_spec& spec, std::span<std::byte> external) {
  if (!device_.is_cpu())
    throw_error(errc::invalid_argument,
                std::string(who) + ": add('" + spec.name + "', span) wraps host memory, this target's tensors are on " +
                    to_string(device_) + " (add a tensor_view on " + to_string(device_) + " instead)");
  return add_entry(spec, external.data(), external.size(), true);
}

tensor_view tensor_map_target::add(const tensor_view& external) {
  const tensor_spec spec = external.spec();
  if (!(external.device == device_))
    throw_error(errc::invalid_argument, std::string(who) + ": external memory for '" + spec.name + "' is on " +
                                            to_string(external.device) + ", this target's tensors are on " +
                                            to_string(device_));
  const std::uint64_t n = spec.nbytes();  // validates the shape
  auto first = add_entry(spec, external.data, n, true);
  return tensor_view(tensors_.back().spec, first.data(), device_);
}

std::span<std::byte> tensor_map_target::add_entry(const tensor_spec& spec, std::byte* external,
                                                  std::uint64_t external_bytes, bool has_external) {
  std::lock_guard lock(mutex_);
  if (current_)
    throw_error(errc::invalid_state, std::string(who) + ": add('" + spec.name +
                                         "') after the target was first used (add every tensor before it is "
                                         "read, updated or fingerprinted)");
  if (spec.name.empty()) throw_error(errc::invalid_argument, std::string(who) + ": a tensor needs a name");
  if (index_.count(spec.name))
    throw_error(errc::invalid_argument, std::string(who) + ": tensor '" + spec.name + "' was already added");
  const std::uint64_t n = spec.nbytes();  // validates the shape
  if (has_external && external_bytes != n)
    throw_error(errc::invalid_argument, std::string(who) + ": external memory for '" + spec.name + "' is " +
                                            std::to_string(external_bytes) + " bytes, the tensor " +
                                            shape_to_string(spec.shape) + " " + std::string(to_string(spec.dtype)) +
                                            " needs " + std::to_string(n));
  if (has_external && n != 0 && external == nullptr)
    throw_error(errc::invalid_argument, std::string(who) + ": external memory for '" + spec.name + "' is null");
  entry e;
  e.spec = spec;
  e.nbytes = n;
  const int copies = options_.mode == reader_mode::double_buffered ? 2 : 1;
  for (int c = 0; c < copies; ++c) {
    if (c == 0 && has_external && n != 0) {
      e.buf[0] = external;
      continue;
    }
    // Even an empty tensor has an address; zeroed (on the host: and faulted in)
    // here, not when the first update lands.
    std::byte* p = memory_->allocate_zeroed(n);
    if (!p)
      throw_error(errc::resource_exhausted, std::string(who) + ": cannot allocate " + std::to_string(n) + " bytes on " +
                                                to_string(device_) + " for '" + spec.name + "'");
    e.own[c] = std::unique_ptr<std::byte, memory_deleter>(p, memory_deleter{memory_.get()});
    e.buf[c] = e.own[c].get();
  }
  tensors_.push_back(std::move(e));
  const entry& added = tensors_.back();
  index_.emplace(added.spec.name, tensors_.size() - 1);
  written_.push_back(0);
  return {added.buf[0], static_cast<std::size_t>(n)};
}

std::vector<tensor_spec> tensor_map_target::specs() const {
  std::vector<tensor_spec> out;
  out.reserve(tensors_.size());
  for (const auto& e : tensors_) out.push_back(e.spec);
  return out;
}

update_metadata tensor_map_target::metadata() const { return {specs()}; }

// ---------------------------------------------------------------- state

std::shared_ptr<const tensor_map_target::snapshot> tensor_map_target::make_snapshot_locked(
    std::uint64_t generation, std::optional<std::int64_t> version, std::string dirty_reason) const {
  auto s = std::make_unique<snapshot>();
  s->generation = generation;
  s->version = dirty_reason.empty() ? version : std::nullopt;
  s->dirty_reason = std::move(dirty_reason);
  s->data.reserve(tensors_.size());
  for (const auto& e : tensors_) s->data.push_back(e.buf[options_.mode == reader_mode::double_buffered ? e.front : 0]);
  ++live_snapshots_;
  // The last reference (the target's or a guard's) counts the snapshot out, so an
  // update knows when no guard reads an old generation any more. Never dropped
  // while mutex_ is held.
  const tensor_map_target* self = this;
  return std::shared_ptr<const snapshot>(s.release(), [self](const snapshot* p) {
    delete p;
    {
      std::lock_guard lock(self->mutex_);
      --self->live_snapshots_;
    }
    self->changed_.notify_all();
  });
}

std::shared_ptr<const tensor_map_target::snapshot> tensor_map_target::publish_locked(
    std::shared_ptr<const snapshot> next) const {
  std::swap(current_, next);
  return next;  // the old one: the caller drops it after unlocking
}

void tensor_map_target::seal_locked() const {
  if (current_) return;
  // First use: the tensor set is fixed from now on.
  current_ = make_snapshot_locked(0, options_.initial_version, {});
}

const tensor_map_target::entry* tensor_map_target::lookup(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::byte* tensor_map_target::write_buffer_locked(const entry& e) const {
  return options_.mode == reader_mode::double_buffered ? e.buf[1 - e.front] : e.buf[0];
}

void tensor_map_target::acquire_write(std::unique_lock<std::mutex>& lock) {
  open_ = true;
  if (writing_) return;
  if (options_.mode == reader_mode::reader_lock) {
    // Writer preference: new readers wait from now on; the guards held now finish.
    ++writers_waiting_;
    changed_.wait(lock, [this] { return writing_ || readers_ == 0; });
    --writers_waiting_;
  } else {
    // Guards of older generations may still read what are now back copies.
    changed_.wait(lock, [this] { return writing_ || live_snapshots_ == 1; });
  }
  writing_ = true;
}

void tensor_map_target::release_shared() const noexcept {
  std::lock_guard lock(mutex_);
  if (--readers_ == 0) changed_.notify_all();
}

// ---------------------------------------------------------------- readers

tensor_map_target::reader tensor_map_target::read() const {
  std::unique_lock lock(mutex_);
  seal_locked();
  const bool locking = options_.mode == reader_mode::reader_lock;
  if (locking) {
    changed_.wait(lock, [this] { return !writing_ && writers_waiting_ == 0; });
    ++readers_;
  }
  return reader(this, current_, locking);
}

std::optional<tensor_map_target::reader> tensor_map_target::try_read() const {
  std::unique_lock lock(mutex_);
  seal_locked();
  const bool locking = options_.mode == reader_mode::reader_lock;
  if (locking) {
    if (writing_ || writers_waiting_ > 0) return std::nullopt;
    ++readers_;
  }
  return reader(this, current_, locking);
}

std::optional<std::int64_t> tensor_map_target::version() const {
  std::lock_guard lock(mutex_);
  seal_locked();
  return current_->version;
}

std::uint64_t tensor_map_target::generation() const {
  std::lock_guard lock(mutex_);
  seal_locked();
  return current_->generation;
}

bool tensor_map_target::dirty() const {
  std::lock_guard lock(mutex_);
  seal_locked();
  return !current_->dirty_reason.empty();
}

std::string tensor_map_target::dirty_reason() const {
  std::lock_guard lock(mutex_);
  seal_locked();
  return current_->dirty_reason;
}

bool tensor_map_target::updating() const {
  std::lock_guard lock(mutex_);
  return open_;
}

bool tensor_map_target::writing() const {
  std::lock_guard lock(mutex_);
  return writing_;
}

// ---------------------------------------------------------------- updates

void tensor_map_target::start() {
  std::lock_guard lock(mutex_);
  seal_locked();
  open_ = true;
}

void tensor_map_target::finish(std::optional<std::int64_t> version) {
  std::shared_ptr<const snapshot> old;
  {
    std::lock_guard lock(mutex_);
    seal_locked();
    if (loads_ > 0)
      throw_error(errc::invalid_state, std::string(who) +
                                           ": finish while load_weights of the update is still "
                                           "running (finish after its receive and processing "
                                           "completed: drain_pending / finish_weight_update)");
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (!written_[i]) continue;
      // double_buffered: the back copy holds the update, it is served from now on.
      if (options_.mode == reader_mode::double_buffered) tensors_[i].front ^= 1;
      written_[i] = 0;
    }
    old = publish_locked(make_snapshot_locked(current_->generation + 1, version, {}));
    open_ = false;
    writing_ = false;
  }
  changed_.notify_all();
}

void tensor_map_target::abort(const std::string& reason) {
  std::shared_ptr<const snapshot> old;
  {
    std::lock_guard lock(mutex_);
    seal_locked();
    if (loads_ > 0)
      throw_error(errc::invalid_state, std::string(who) +
                                           ": abort while load_weights of the update is still "
                                           "running (abort after its receive and processing ended)");
    if (writing_) {
      if (options_.mode == reader_mode::reader_lock) {
        std::string why = "an update was aborted after it had started writing the weights";
        if (current_->version)
          why += " (they were at version " + std::to_string(*current_->version) + ")";
        else if (!current_->dirty_reason.empty())
          why += " (they were dirty already)";
        if (!reason.empty()) why += ": " + reason;
        old = publish_locked(make_snapshot_locked(current_->generation + 1, std::nullopt, std::move(why)));
      } else {
        std::fill(written_.begin(), written_.end(), 0);  // the back copies are discarded
      }
    }
    open_ = false;
    writing_ = false;
  }
  changed_.notify_all();
}

void tensor_map_target::begin_update(const update_metadata& meta) {
  {
    std::lock_guard lock(mutex_);
    seal_locked();
  }
  for (const auto& t : meta.tensors) {
    const entry* e = lookup(t.name);
    if (!e)
      throw_error(errc::invalid_argument, std::string(who) + ": the update's tensor '" + t.name +
                                              "' is not a tensor of this model (" + std::to_string(tensors_.size()) +
                                              " tensors); nothing was received");
    if (std::string diff = mismatch(e->spec, t.dtype, t.shape); !diff.empty())
      throw_error(errc::invalid_argument,
                  std::string(who) + ": the update's tensor '" + t.name + "' has " + diff + "; nothing was received");
  }
  std::lock_guard lock(mutex_);
  open_ = true;
}

bool tensor_map_target::can_read_back(const tensor_spec& spec) {
  const entry* e = lookup(spec.name);
  return e && mismatch(e->spec, spec.dtype, spec.shape).empty();
}

void tensor_map_target::read_back(const tensor_spec& spec, std::span<std::byte> out) {
  const entry* e = lookup(spec.name);
  if (!e || !mismatch(e->spec, spec.dtype, spec.shape).empty() || out.size() != e->nbytes)
    throw_error(errc::invalid_argument, std::string(who) + ": read_back: no tensor '" + spec.name +
                                            "' of that dtype "
                                            "and shape");
  const std::byte* served = nullptr;
  {
    std::lock_guard lock(mutex_);
    served = e->buf[options_.mode == reader_mode::double_buffered ? e->front : 0];
  }
  if (e->nbytes != 0) memory_->copy_out(out, served);
}

std::optional<tensor_view> tensor_map_target::destination(const tensor_spec& spec) {
  if (!options_.direct_receive) return std::nullopt;
  // Engines refuse a destination on another device than theirs: device memory is
  // offered only to an engine the application says receives on that device.
  if (!device_.is_cpu() && !options_.direct_receive_on_device) return std::nullopt;
  const entry* e = lookup(spec.name);
  if (!e || !mismatch(e->spec, spec.dtype, spec.shape).empty()) return std::nullopt;
  std::lock_guard lock(mutex_);
  seal_locked();
  open_ = true;
  return tensor_view(e->spec, write_buffer_locked(*e), device_);
}

void tensor_map_target::direct_write_begins() {
  std::unique_lock lock(mutex_);
  seal_locked();
  acquire_write(lock);
}

void tensor_map_target::load_weights(std::span<const tensor_view> weights) {
  const std::vector<std::size_t> at = checked_batch(weights);
  std::vector<std::byte*> into = begin_writing(at);
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const std::uint64_t n = tensors_[at[i]].nbytes;
    // Received directly: already in place.
    if (n == 0 || into[i] == weights[i].data) continue;
    try {
      memory_->copy_in(into[i], weights[i]);
    } catch (...) {
      std::lock_guard lock(mutex_);
      --loads_;
      throw;
    }
  }
  std::lock_guard lock(mutex_);
  --loads_;
}

bool tensor_map_target::can_exchange() const { return options_.mode == reader_mode::reader_lock && device_.is_cpu(); }

void tensor_map_target::exchange(std::span<const tensor_view> staged) {
  if (!can_exchange())
    throw_error(errc::unsupported, std::string(who) + ": exchange needs reader_lock mode and host memory");
  const std::vector<std::size_t> at = checked_batch(staged);
  for (const auto& v : staged)
    if (!v.device.is_cpu())
      throw_error(errc::unsupported, std::string(who) + ": exchange got tensor '" + std::string(v.name) + "' on " +
                                         to_string(v.device) + "; nothing of the batch was written");
  std::vector<std::byte*> into = begin_writing(at);
  // Through a small buffer that stays in cache: one pass over each side.
  constexpr std::size_t block = 64 << 10;
  std::vector<std::byte> tmp(block);
  for (std::size_t i = 0; i < staged.size(); ++i) {
    auto* model = into[i];
    auto* stage = static_cast<std::byte*>(staged[i].data);
    const std::uint64_t n = tensors_[at[i]].nbytes;
    if (n == 0 || model == stage) continue;
    for (std::uint64_t off = 0; off < n; off += block) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(block, n - off));
      std::memcpy(tmp.data(), model + off, k);
      std::memcpy(model + off, stage + off, k);
      std::memcpy(stage + off, tmp.data(), k);
    }
  }
  std::lock_guard lock(mutex_);
  --loads_;
}

std::vector<std::size_t> tensor_map_target::checked_batch(std::span<const tensor_view> weights) {
  {
    std::lock_guard lock(mutex_);
    seal_locked();
  }
  // The whole batch is checked before any of it is written.
  std::vector<std::size_t> at(weights.size());
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const auto& v = weights[i];
    auto it = index_.find(v.name);
    if (it == index_.end())
      throw_error(errc::invalid_argument, std::string(who) + ": load_weights got tensor '" + std::string(v.name) +
                                              "', which is not a tensor of this model; nothing of the batch was "
                                              "written");
    const entry& e = tensors_[it->second];
    if (std::string diff = mismatch(e.spec, v.dtype, v.shape); !diff.empty())
      throw_error(errc::invalid_argument, std::string(who) + ": load_weights got tensor '" + e.spec.name + "' with " +
                                              diff + "; nothing of the batch was written");
    if (!v.device.is_cpu() && !(v.device == device_))
      throw_error(errc::unsupported, std::string(who) + ": load_weights got tensor '" + e.spec.name + "' on " +
                                         to_string(v.device) + "; this target's tensors are on " + to_string(device_) +
                                         " and it loads views on the host" +
                                         (device_.is_cpu() ? std::string() : " or on " + to_string(device_)) +
                                         "; nothing of the batch was written");
    if (v.data == nullptr && e.nbytes != 0)
      throw_error(errc::invalid_argument,
                  std::string(who) + ": load_weights got tensor '" + e.spec.name + "' without data");
    at[i] = it->second;
  }
  return at;
}

std::vector<std::byte*> tensor_map_target::begin_writing(const std::vector<std::size_t>& at) {
  std::vector<std::byte*> into(at.size());
  std::unique_lock lock(mutex_);
  ++loads_;  // counted while it waits too: finish/abort now would release what it is about to write
  acquire_write(lock);
  for (std::size_t i = 0; i < at.size(); ++i) {
    into[i] = write_buffer_locked(tensors_[at[i]]);
    written_[at[i]] = 1;
  }
  return into;
}

fingerprint_list tensor_map_target::fingerprint(const std::vector<std::string>& names) {
  auto r = try_read();  // never waits (see the threading contract)
  if (!r)
    throw_error(errc::invalid_state, std::string(who) +
                                         ": the weights are being updated (an update has been "
                                         "writing them since its first byte); fingerprint them "
                                         "after it finishes");
  if (device_.is_cpu()) {
    std::vector<tensor_view> views;
    views.reserve(r->size());
    for (auto v : *r) views.push_back(v);
    return fingerprint_all(views, names);
  }
  // Device memory: each tensor is copied to one host buffer and hashed there, so
  // the fingerprints are those of host tensors of the same bytes.
  std::vector<std::size_t> which;
  if (names.empty()) {
    which.resize(tensors_.size());
    for (std::size_t i = 0; i < which.size(); ++i) which[i] = i;
  } else {
    which.reserve(names.size());
    for (const auto& n : names) {
      auto it = index_.find(n);
      if (it == index_.end()) throw_error(errc::invalid_argument, "fingerprint: no weight named '" + n + "'");
      which.push_back(it->second);
    }
  }
  std::uint64_t largest = 0;
  for (auto i : which) largest = std::max(largest, tensors_[i].nbytes);
  std::vector<std::byte> host(static_cast<std::size_t>(largest));
  fingerprint_list out;
  out.reserve(which.size());
  for (auto i : which) {
    const entry& e = tensors_[i];
    const std::span<std::byte> bytes(host.data(), static_cast<std::size_t>(e.nbytes));
    if (e.nbytes != 0) memory_->copy_out(bytes, (*r)[i].data);
    out.emplace_back(e.spec.name, refit::fingerprint(tensor_view(e.spec, host.data())));
  }
  return out;
}

}  // namespace refit
