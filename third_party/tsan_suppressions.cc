// Linked into every test binary (through //third_party:gtest_main); read only by
// ThreadSanitizer builds. libstdc++ is not instrumented, so TSan cannot see the
// atomic reference count inside std::exception_ptr: an exception created on one
// thread (a pool or strand running a coroutine) and released there after it was
// handed to another thread through asio's (instrumented) queues is reported as a
// race on the exception object. The hand-over itself is synchronised.
extern "C" const char* __tsan_default_suppressions() {
  return "race:std::__exception_ptr::exception_ptr::_M_release\n";
}
