// Runs without a GPU: error formatting needs only the CUDA runtime library.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <system_error>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>

namespace refit::cuda {
namespace {

using ::testing::HasSubstr;

int calls = 0;

cudaError_t returns(cudaError_t status) {
  ++calls;
  return status;
}

TEST(CudaError, CategoryIsRefitCudaAndUsesCudaMessages) {
  EXPECT_STREQ(cuda_category().name(), "refit.cuda");
  EXPECT_EQ(cuda_category().message(cudaErrorInvalidValue), "invalid argument");
  EXPECT_EQ(make_error_code(cudaErrorInvalidValue).value(), int{cudaErrorInvalidValue});
  EXPECT_EQ(&make_error_code(cudaErrorInvalidValue).category(), &cuda_category());
  // Unknown codes still produce a message rather than crashing.
  EXPECT_FALSE(cuda_category().message(987654).empty());
}

TEST(CudaError, MessageNamesCallLocationErrorNameAndDescription) {
  const cuda_error error(cudaErrorInvalidValue, "cudaMalloc(&p, 16)");
  const std::string what = error.what();
  EXPECT_THAT(what, HasSubstr("cudaMalloc(&p, 16) failed at "));
  EXPECT_THAT(what, HasSubstr("tests/cuda/cuda_error_test.cc:"));
  EXPECT_THAT(what, HasSubstr("(cudaErrorInvalidValue): invalid argument"));
  EXPECT_EQ(error.code(), make_error_code(cudaErrorInvalidValue));
  EXPECT_EQ(error.status(), cudaErrorInvalidValue);
  EXPECT_EQ(error.call(), "cudaMalloc(&p, 16)");
}

TEST(CudaCheck, ThrowsCudaErrorAsSystemErrorWithTheCallText) {
  calls = 0;
  try {
    REFIT_CUDA_CHECK(returns(cudaErrorInvalidValue));
    FAIL() << "REFIT_CUDA_CHECK did not throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().category().name(), std::string("refit.cuda"));
    EXPECT_EQ(e.code().value(), int{cudaErrorInvalidValue});
    EXPECT_THAT(std::string(e.what()), HasSubstr("returns(cudaErrorInvalidValue) failed at "));
    EXPECT_THAT(std::string(e.what()), HasSubstr("invalid argument"));
    ASSERT_NE(dynamic_cast<const cuda_error*>(&e), nullptr);
  }
  EXPECT_EQ(calls, 1);
}

TEST(CudaCheck, SuccessEvaluatesTheCallOnceAndDoesNotThrow) {
  calls = 0;
  EXPECT_NO_THROW(REFIT_CUDA_CHECK(returns(cudaSuccess)));
  EXPECT_EQ(calls, 1);
}

TEST(DeviceCount, EitherDevicesOrAReason) {
  const device_count_result result = device_count_or_reason();
  if (result) {
    EXPECT_GT(result.count, 0);
    EXPECT_TRUE(result.reason.empty()) << result.reason;
  } else {
    EXPECT_EQ(result.count, 0);
    // Names the call and says why, e.g. "cudaGetDeviceCount failed: CUDA driver
    // version is insufficient for CUDA runtime version (cudaErrorInsufficientDriver)".
    EXPECT_THAT(result.reason, ::testing::StartsWith("cudaGetDeviceCount "));
    EXPECT_GT(result.reason.size(), std::string("cudaGetDeviceCount failed: ").size());
  }
}

}  // namespace
}  // namespace refit::cuda
