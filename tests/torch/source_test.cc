// lib/torch/source.h: the trainer-side source over a module or a range of named
// tensors: order, zero-copy views, declared metadata and early errors.
#include <refit/torch/source.h>

#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "tests/lib/expect.h"

namespace refit::libtorch {
namespace {

using ::testing::HasSubstr;

struct block : torch::nn::Module {
  block() {
    w = register_parameter("w", at::ones({2, 3}));
    b = register_parameter("b", at::zeros({2}, at::kBFloat16));
  }
  at::Tensor w, b;
};

struct net : torch::nn::Module {
  net() {
    embed = register_parameter("embed", at::arange(8, at::kFloat).reshape({4, 2}));
    layer = register_module("layer", std::make_shared<block>());
    steps = register_buffer("steps", at::zeros({1}, at::kLong));
  }
  at::Tensor embed, steps;
  std::shared_ptr<block> layer;
};

std::vector<std::string> names_of(const update_metadata& m) {
  std::vector<std::string> out;
  for (const auto& t : m.tensors) out.push_back(t.name);
  return out;
}

TEST(named_tensors, lists_parameters_then_buffers_with_dotted_names) {
  net model;
  auto all = named_tensors(model);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].first, "embed");
  EXPECT_EQ(all[1].first, "layer.w");
  EXPECT_EQ(all[2].first, "layer.b");
  EXPECT_EQ(all[3].first, "steps");
  EXPECT_TRUE(all[0].second.is_same(model.embed));

  EXPECT_EQ(named_tensors(model, {.parameters = true, .buffers = false}).size(), 3u);
  EXPECT_EQ(named_tensors(model, {.parameters = false, .buffers = true}).size(), 1u);
  EXPECT_EQ(named_tensors(model, {.parameters = true, .buffers = true, .recurse = false}).size(), 2u);
}

TEST(torch_source, yields_zero_copy_views_of_a_modules_tensors_in_order) {
  net model;
  torch_source source(model);
  EXPECT_EQ(names_of(source.metadata()), (std::vector<std::string>{"embed", "layer.w", "layer.b", "steps"}));
  EXPECT_EQ(source.metadata().tensors[2], (tensor_spec{"layer.b", dtype::bfloat16, {2}}));
  EXPECT_EQ(source.metadata().tensors[3], (tensor_spec{"steps", dtype::int64, {1}}));

  std::vector<void*> data;
  while (auto v = source.next()) data.push_back(v->data);
  EXPECT_EQ(data, (std::vector<void*>{model.embed.data_ptr(), model.layer->w.data_ptr(), model.layer->b.data_ptr(),
                                      model.steps.data_ptr()}));
  EXPECT_FALSE(source.next().has_value());

  // The next update sends the same tensors' new values.
  model.embed.data().fill_(7.0f);
  source.rewind();
  auto v = source.next();
  ASSERT_TRUE(v);
  EXPECT_EQ(v->name, "embed");
  EXPECT_EQ(reinterpret_cast<float*>(v->data)[3], 7.0f);
}

TEST(torch_source, its_views_match_what_it_declares) {
  net model;
  torch_source source(model, {.parameters = true, .buffers = false});
  auto views = source.views();
  EXPECT_EQ(describe(views).tensors, source.metadata().tensors);
  for (std::size_t i = 0; i < views.size(); ++i)
    EXPECT_NO_THROW(check_matches_declared(source.metadata().tensors[i], views[i], i));
}

TEST(torch_source, takes_any_range_of_named_tensors) {
  std::map<std::string, at::Tensor> map{{"b", at::zeros({3})}, {"a", at::zeros({2}, at::kHalf)}};
  torch_source from_map(map);
  EXPECT_EQ(names_of(from_map.metadata()), (std::vector<std::string>{"a", "b"}));

  std::vector<std::tuple<const char*, at::Tensor>> tuples{{"x", at::zeros({1})}};
  EXPECT_EQ(torch_source(tuples).metadata().tensors[0].name, "x");

  net model;
  torch_source from_dict(model.named_parameters());
  EXPECT_EQ(names_of(from_dict.metadata()), (std::vector<std::string>{"embed", "layer.w", "layer.b"}));
  EXPECT_EQ(from_dict.size(), 3u);
}

TEST(torch_source, refuses_a_non_contiguous_tensor_by_name_unless_asked_to_copy) {
  at::Tensor base = at::arange(6, at::kFloat).reshape({2, 3});
  std::vector<named_tensor> tensors{{"ok", at::zeros({1})}, {"transposed", base.t()}};
  auto e = REFIT_THROWN(torch_source{tensors});
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'transposed' of shape [3, 2] is not contiguous"));

  torch_source copying(tensors, /*contiguous_copies=*/true);
  EXPECT_EQ(copying.metadata().tensors[1], (tensor_spec{"transposed", dtype::float32, {3, 2}}));
  copying.next();
  auto v = copying.next();
  ASSERT_TRUE(v);
  EXPECT_NE(static_cast<void*>(v->data), base.data_ptr());
  const float* f = reinterpret_cast<const float*>(v->data);
  EXPECT_EQ(std::vector<float>(f, f + 6), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(torch_source, refuses_duplicate_or_empty_names_and_unsupported_tensors) {
  auto duplicate = REFIT_THROWN(torch_source(std::vector<named_tensor>{{"w", at::zeros({1})}, {"w", at::zeros({1})}}));
  EXPECT_EQ(duplicate.kind(), errc::invalid_argument);
  EXPECT_THAT(duplicate.message(), HasSubstr("'w'"));

  auto empty = REFIT_THROWN(torch_source(std::vector<named_tensor>{{"", at::zeros({1})}}));
  EXPECT_EQ(empty.kind(), errc::invalid_argument);

  auto complex = REFIT_THROWN(torch_source(std::vector<named_tensor>{{"c", at::zeros({1}, at::kComplexDouble)}}));
  EXPECT_EQ(complex.kind(), errc::unsupported);
  EXPECT_THAT(complex.message(), HasSubstr("tensor 'c'"));
}

}  // namespace
}  // namespace refit::libtorch
