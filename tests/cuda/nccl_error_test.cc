// Runs without a GPU: NCCL's error strings and argument checks need no device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <system_error>

#include <refit/cuda/nccl_error.h>

namespace refit::cuda {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int calls = 0;

ncclResult_t returns(ncclResult_t result) {
  ++calls;
  return result;
}

TEST(NcclError, CategoryIsRefitNcclAndUsesNcclMessages) {
  EXPECT_STREQ(nccl_category().name(), "refit.nccl");
  EXPECT_EQ(nccl_category().message(ncclInvalidArgument), ncclGetErrorString(ncclInvalidArgument));
  EXPECT_EQ(make_error_code(ncclSystemError).value(), int{ncclSystemError});
  EXPECT_EQ(&make_error_code(ncclSystemError).category(), &nccl_category());
  EXPECT_FALSE(nccl_category().message(987654).empty());
}

TEST(NcclError, ResultNamesCoverEveryResult) {
  EXPECT_EQ(nccl_result_name(ncclSuccess), "ncclSuccess");
  EXPECT_EQ(nccl_result_name(ncclUnhandledCudaError), "ncclUnhandledCudaError");
  EXPECT_EQ(nccl_result_name(ncclSystemError), "ncclSystemError");
  EXPECT_EQ(nccl_result_name(ncclInternalError), "ncclInternalError");
  EXPECT_EQ(nccl_result_name(ncclInvalidArgument), "ncclInvalidArgument");
  EXPECT_EQ(nccl_result_name(ncclInvalidUsage), "ncclInvalidUsage");
  EXPECT_EQ(nccl_result_name(ncclRemoteError), "ncclRemoteError");
  EXPECT_EQ(nccl_result_name(ncclInProgress), "ncclInProgress");
  EXPECT_EQ(nccl_result_name(static_cast<ncclResult_t>(42)), "ncclResult_t(42)");
}

TEST(NcclError, MessageNamesCallLocationResultDetailAndDescription) {
  const nccl_error error(ncclRemoteError, "ncclAllReduce(a, b, n, ncclFloat, ncclSum, c, s)",
                         "peer 3 closed the connection");
  const std::string what = error.what();
  EXPECT_THAT(what, HasSubstr("ncclAllReduce(a, b, n, ncclFloat, ncclSum, c, s) failed at "));
  EXPECT_THAT(what, HasSubstr("tests/cuda/nccl_error_test.cc:"));
  EXPECT_THAT(what, HasSubstr("(ncclRemoteError; NCCL: peer 3 closed the connection): "));
  EXPECT_THAT(what, HasSubstr(ncclGetErrorString(ncclRemoteError)));
  EXPECT_EQ(error.result(), ncclRemoteError);
  EXPECT_EQ(error.code(), make_error_code(ncclRemoteError));
  EXPECT_EQ(error.last_error(), "peer 3 closed the connection");

  const nccl_error bare(ncclInternalError, "ncclCommDestroy(comm)");
  EXPECT_THAT(bare.what(), HasSubstr("(ncclInternalError): "));
  EXPECT_THAT(bare.what(), Not(HasSubstr("NCCL:")));
}

TEST(NcclCheck, ARealFailureCarriesNcclsOwnDetail) {
  calls = 0;
  try {
    // NCCL checks the pointer before anything needs a device.
    REFIT_NCCL_CHECK(ncclGetUniqueId(nullptr));
    FAIL() << "REFIT_NCCL_CHECK did not throw";
  } catch (const nccl_error& e) {
    EXPECT_EQ(e.result(), ncclInvalidArgument);
    EXPECT_EQ(e.call(), "ncclGetUniqueId(nullptr)");
    EXPECT_THAT(e.what(), HasSubstr("ncclGetUniqueId(nullptr) failed at "));
    EXPECT_THAT(e.what(), HasSubstr("ncclInvalidArgument"));
    // NCCL's text for this failure names the argument (e.g. "GetUniqueId : out
    // argument is NULL"); it has no trailing newline.
    EXPECT_FALSE(e.last_error().empty());
    EXPECT_NE(e.last_error().back(), '\n');
    std::printf("what(): %s\n", e.what());
  }
}

TEST(NcclCheck, ThrowsAsSystemErrorWithTheCallText) {
  calls = 0;
  try {
    REFIT_NCCL_CHECK_COMM(nullptr, returns(ncclSystemError));
    FAIL() << "REFIT_NCCL_CHECK_COMM did not throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().category().name(), std::string("refit.nccl"));
    EXPECT_EQ(e.code().value(), int{ncclSystemError});
    EXPECT_THAT(e.what(), HasSubstr("returns(ncclSystemError) failed at "));
    ASSERT_NE(dynamic_cast<const nccl_error*>(&e), nullptr);
  }
  EXPECT_EQ(calls, 1);
}

TEST(NcclCheck, SuccessAndInProgressDoNotThrowAndEvaluateOnce) {
  calls = 0;
  EXPECT_NO_THROW(REFIT_NCCL_CHECK(returns(ncclSuccess)));
  // Non-blocking communicators answer ncclInProgress for accepted work.
  EXPECT_NO_THROW(REFIT_NCCL_CHECK(returns(ncclInProgress)));
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace refit::cuda
