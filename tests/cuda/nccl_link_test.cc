// Runs without a GPU: checks that @refit_local_cuda//:nccl links and that the libnccl.so.2
// found at run time is the release whose nccl.h this binary was compiled against.
#include <gtest/gtest.h>
#include <nccl.h>

namespace {

TEST(Nccl, RuntimeLibraryMatchesTheHeader) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9.
  EXPECT_EQ(version / 100, NCCL_VERSION_CODE / 100)
      << "runtime NCCL " << version << ", header NCCL " << NCCL_VERSION_CODE;
}

TEST(Nccl, ErrorStringsNeedNoDevice) { EXPECT_STRNE(ncclGetErrorString(ncclInvalidArgument), ""); }

}  // namespace
