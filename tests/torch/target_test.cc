// lib/torch/target.h: every mapping rule (renames, ignore, fused parameters,
// tensor-parallel shards, dtype conversion) and every validation error, each
// checked to leave the model untouched.
#include <refit/torch/target.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "tests/lib/expect.h"

namespace refit::libtorch {
namespace {

using ::testing::HasSubstr;

// The update a trainer would send: names and tensors (contiguous, on cpu).
struct update {
  std::vector<named_tensor> tensors;

  update_metadata metadata() const {
    update_metadata m;
    for (const auto& [name, t] : tensors) m.tensors.push_back(to_view(t, name).spec());
    return m;
  }
  std::vector<tensor_view> views() const {
    std::vector<tensor_view> out;
    for (const auto& [name, t] : tensors) out.push_back(to_view(t, name));
    return out;
  }
};

// begin_update + one load_weights with the whole update.
void apply(module_target& target, const update& u) {
  target.begin_update(u.metadata());
  target.load_weights(u.views());
}

at::Tensor range(std::int64_t rows, std::int64_t cols, float start = 0) {
  return at::arange(rows * cols, at::kFloat).reshape({rows, cols}) + start;
}

// Model tensors and snapshots of their values, to prove nothing was written.
struct model {
  std::vector<named_tensor> tensors;
  std::vector<at::Tensor> before;

  explicit model(std::vector<named_tensor> t) : tensors(std::move(t)) {
    for (const auto& [_, x] : tensors) before.push_back(x.clone());
  }
  at::Tensor& operator[](std::string_view name) {
    for (auto& [n, t] : tensors)
      if (n == name) return t;
    throw std::out_of_range(std::string(name));
  }
  bool untouched() const {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (!at::equal(tensors[i].second, before[i])) return false;
    return true;
  }
};

// ---------------------------------------------------------------- plain loads

TEST(module_target, copies_into_the_existing_tensors_in_place) {
  model m({{"w", at::zeros({2, 3})}, {"b", at::zeros({2}, at::kLong)}});
  const void* w_address = m["w"].data_ptr();
  module_target target(m.tensors);
  apply(target, {{{"w", range(2, 3, 1)}, {"b", at::tensor({5, 6}, at::kLong)}}});
  EXPECT_TRUE(at::equal(m["w"], range(2, 3, 1)));
  EXPECT_TRUE(at::equal(m["b"], at::tensor({5, 6}, at::kLong)));
  EXPECT_EQ(m["w"].data_ptr(), w_address) << "the parameter must keep its address (CUDA graphs)";
}

TEST(module_target, updates_a_modules_parameters_and_buffers_that_require_grad) {
  struct net : torch::nn::Module {
    net() {
      w = register_parameter("w", at::zeros({2, 2}));
      steps = register_buffer("steps", at::zeros({1}, at::kLong));
    }
    at::Tensor w, steps;
  } module;
  ASSERT_TRUE(module.w.requires_grad());
  module_target target(module);
  apply(target, {{{"w", range(2, 2)}, {"steps", at::tensor({9}, at::kLong)}}});
  EXPECT_TRUE(at::equal(module.w.detach(), range(2, 2)));
  EXPECT_EQ(module.steps.item<std::int64_t>(), 9);
  EXPECT_TRUE(module.w.requires_grad());
}

TEST(module_target, loads_an_update_in_any_batches_and_order) {
  model m({{"a", at::zeros({2})}, {"b", at::zeros({3})}, {"c", at::zeros({1})}});
  module_target target(m.tensors);
  update u{{{"a", at::ones({2})}, {"b", at::full({3}, 2.0f)}, {"c", at::full({1}, 3.0f)}}};
  target.begin_update(u.metadata());
  auto views = u.views();
  target.load_weights(std::span(views).subspan(2, 1));
  target.load_weights(std::span(views).subspan(0, 2));
  EXPECT_TRUE(at::equal(m["a"], at::ones({2})));
  EXPECT_TRUE(at::equal(m["b"], at::full({3}, 2.0f)));
  EXPECT_TRUE(at::equal(m["c"], at::full({1}, 3.0f)));
}

// ---------------------------------------------------------------- load_weights' own checks

TEST(module_target, load_weights_before_begin_update_is_invalid_state) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors);
  update u{{{"w", at::ones({2})}}};
  auto e = REFIT_THROWN(target.load_weights(u.views()));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_THAT(e.message(), HasSubstr("load_weights before begin_update"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, load_weights_refuses_a_tensor_not_announced_and_writes_nothing_of_its_batch) {
  model m({{"w", at::zeros({2})}, {"v", at::zeros({2})}});
  module_target target(m.tensors, {.require_complete = false});
  target.begin_update(update{{{"w", at::ones({2})}}}.metadata());
  update batch{{{"w", at::ones({2})}, {"v", at::ones({2})}}};
  auto e = REFIT_THROWN(target.load_weights(batch.views()));
  EXPECT_EQ(e.kind(), errc::invalid_state);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'v' was not in the update announced to begin_update"));
  EXPECT_TRUE(m.untouched()) << "'w' came first in the batch but must not be written";
}

TEST(module_target, load_weights_refuses_a_tensor_that_differs_from_its_announcement) {
  model m({{"w", at::zeros({4})}});
  module_target target(m.tensors);
  target.begin_update(update{{{"w", at::ones({4})}}}.metadata());
  auto shape = REFIT_THROWN(target.load_weights(update{{{"w", at::ones({2, 2})}}}.views()));
  EXPECT_EQ(shape.kind(), errc::invalid_argument);
  EXPECT_THAT(shape.message(), HasSubstr("tensor 'w' arrived as float32 [2, 2], announced as float32 [4]"));
  auto type = REFIT_THROWN(target.load_weights(update{{{"w", at::ones({4}, at::kHalf)}}}.views()));
  EXPECT_EQ(type.kind(), errc::invalid_argument);
  EXPECT_THAT(type.message(), HasSubstr("arrived as float16 [4], announced as float32 [4]"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, a_refused_begin_update_keeps_the_previous_announcement) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors);
  update good{{{"w", at::ones({2})}}};
  target.begin_update(good.metadata());
  EXPECT_THROW(target.begin_update(update{{{"w", at::ones({3})}}}.metadata()), refit::error);
  target.load_weights(good.views());
  EXPECT_TRUE(at::equal(m["w"], at::ones({2})));
}

// ---------------------------------------------------------------- validation errors

TEST(module_target, an_unknown_name_is_refused_by_name_before_any_write) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors);
  update u{{{"w", at::ones({2})}, {"extra", at::ones({1})}}};
  auto e = REFIT_THROWN(target.begin_update(u.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "module_target: update tensor 'extra' is not a tensor of the model");
  EXPECT_THROW(target.load_weights(u.views()), refit::error) << "a refused update cannot be loaded";
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, an_unknown_renamed_name_shows_both_names) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors, {.renames = {rename_rule::prefix("model.", "")}});
  auto e = REFIT_THROWN(target.validate(update{{{"model.x", at::ones({1})}}}.metadata()));
  EXPECT_THAT(e.message(), HasSubstr("update tensor 'model.x' (model name 'x') is not a tensor of the model"));
}

TEST(module_target, a_missing_model_tensor_is_refused_by_name) {
  model m({{"a", at::zeros({2})}, {"b", at::zeros({2})}, {"c", at::zeros({2})}});
  module_target target(m.tensors);
  auto e = REFIT_THROWN(target.begin_update(update{{{"c", at::ones({2})}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("the update misses model tensor 'a' (and up to 1 more)"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, optional_model_tensors_and_partial_updates_may_leave_tensors_out) {
  model m({{"w", at::zeros({2})}, {"rotary.inv_freq", at::zeros({4})}});
  module_target with_optional(m.tensors, {.optional = {"inv_freq$"}});
  apply(with_optional, {{{"w", at::ones({2})}}});
  EXPECT_TRUE(at::equal(m["w"], at::ones({2})));

  module_target partial(m.tensors, {.require_complete = false});
  apply(partial, {{{"rotary.inv_freq", at::ones({4})}}});
  EXPECT_TRUE(at::equal(m["rotary.inv_freq"], at::ones({4})));
}

TEST(module_target, a_shape_mismatch_names_both_tensors_and_shapes) {
  model m({{"w", at::zeros({2, 3})}});
  module_target target(m.tensors);
  auto e = REFIT_THROWN(target.begin_update(update{{{"w", at::ones({3, 2})}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "module_target: shapes of update tensor 'w' [3, 2] and model tensor 'w' [2, 3] do not match");
  auto rank = REFIT_THROWN(target.begin_update(update{{{"w", at::ones({6})}}}.metadata()));
  EXPECT_THAT(rank.message(), HasSubstr("update tensor 'w' [6] and model tensor 'w' [2, 3] differ in rank"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, two_tensors_loading_into_one_place_are_refused) {
  model m({{"layer.w", at::zeros({2})}});
  module_target target(m.tensors, {.renames = {rename_rule::regex("^(a|b)\\.", "layer.")}});
  auto e = REFIT_THROWN(target.begin_update(update{{{"a.w", at::ones({2})}, {"b.w", at::ones({2})}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("update tensors 'a.w' and 'b.w' both load into model tensor 'layer.w'"));
}

TEST(module_target, a_duplicate_name_in_the_update_is_refused) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors);
  update_metadata meta;
  meta.tensors = {{"w", dtype::float32, {2}}, {"w", dtype::float32, {2}}};
  auto e = REFIT_THROWN(target.begin_update(meta));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'w'"));
}

// ---------------------------------------------------------------- dtypes

TEST(module_target, converts_floating_point_dtypes_into_the_model_tensors_dtype) {
  model m({{"f32", at::zeros({3})}, {"bf16", at::zeros({3}, at::kBFloat16)}, {"f16", at::zeros({3}, at::kHalf)}});
  module_target target(m.tensors);
  at::Tensor values = at::tensor({1.5f, -2.25f, 1e-3f});
  apply(target, {{{"f32", values.to(at::kBFloat16)}, {"bf16", values.to(at::kDouble)}, {"f16", values}}});
  EXPECT_TRUE(at::equal(m["f32"], values.to(at::kBFloat16).to(at::kFloat)));
  EXPECT_TRUE(at::equal(m["bf16"], values.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(m["f16"], values.to(at::kHalf)));
  EXPECT_EQ(m["f32"].scalar_type(), at::kFloat) << "the model keeps its dtype";
}

TEST(module_target, integer_and_bool_dtypes_must_match) {
  model m({{"ids", at::zeros({2}, at::kLong)}, {"w", at::zeros({2})}});
  module_target target(m.tensors);
  auto into_int = REFIT_THROWN(target.begin_update(update{{{"ids", at::ones({2})}, {"w", at::ones({2})}}}.metadata()));
  EXPECT_EQ(into_int.kind(), errc::invalid_argument);
  EXPECT_THAT(into_int.message(), HasSubstr("update tensor 'ids' is float32 but model tensor 'ids' is int64; only "
                                            "floating-point dtypes are converted"));
  auto from_int = REFIT_THROWN(
      target.begin_update(update{{{"ids", at::ones({2}, at::kLong)}, {"w", at::ones({2}, at::kInt)}}}.metadata()));
  EXPECT_THAT(from_int.message(), HasSubstr("update tensor 'w' is int32 but model tensor 'w' is float32"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, without_conversion_every_dtype_must_match) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors, {.convert_dtypes = false});
  auto e = REFIT_THROWN(target.begin_update(update{{{"w", at::ones({2}, at::kBFloat16)}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(),
            "module_target: update tensor 'w' is bfloat16 but model tensor 'w' is float32 (dtype "
            "conversion is off)");
}

TEST(module_target, fp8_updates_need_a_libtorch_with_fp8) {
  model m({{"w", at::zeros({2}, at::kBFloat16)}});
  module_target target(m.tensors);
  update_metadata meta;
  meta.tensors = {{"w", dtype::float8_e4m3fn, {2}}};
  if (!has_fp8) {
    auto e = REFIT_THROWN(target.begin_update(meta));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("update tensor 'w' is float8_e4m3fn, which libtorch"));
    EXPECT_THAT(e.message(), HasSubstr("does not have"));
    return;
  }
  target.begin_update(meta);
  std::vector<std::uint8_t> bytes{0x38, 0xc0};  // e4m3fn 1.0, -2.0
  std::vector<tensor_view> views{tensor_view(meta.tensors[0], bytes.data())};
  target.load_weights(views);
  EXPECT_EQ(m["w"][0].item<float>(), 1.0f);
  EXPECT_EQ(m["w"][1].item<float>(), -2.0f);
}

// ---------------------------------------------------------------- renames and ignore

TEST(module_target, prefix_renames_replace_a_leading_prefix) {
  model m({{"layers.0.w", at::zeros({1})}, {"lm_head.w", at::zeros({1})}});
  module_target target(m.tensors, {.renames = {rename_rule::prefix("model.", "")}});
  EXPECT_EQ(target.model_name("model.layers.0.w"), "layers.0.w");
  EXPECT_EQ(target.model_name("lm_head.w"), "lm_head.w") << "no prefix, no change";
  EXPECT_EQ(target.model_name("x.model.w"), "x.model.w") << "only a leading prefix";
  apply(target, {{{"model.layers.0.w", at::ones({1})}, {"lm_head.w", at::full({1}, 2.0f)}}});
  EXPECT_EQ(m["layers.0.w"].item<float>(), 1.0f);
  EXPECT_EQ(m["lm_head.w"].item<float>(), 2.0f);
}

TEST(module_target, regex_renames_use_capture_groups_and_apply_in_order) {
  model m({{"model.blocks.3.attn.w", at::zeros({1})}});
  module_target target(m.tensors,
                       {.renames = {rename_rule::regex("^layers\\.(\\d+)\\.", "blocks.$1."),
                                    rename_rule::prefix("", "model."), rename_rule::regex("self_attn", "attn")}});
  EXPECT_EQ(target.model_name("layers.3.self_attn.w"), "model.blocks.3.attn.w");
  apply(target, {{{"layers.3.self_attn.w", at::full({1}, 4.0f)}}});
  EXPECT_EQ(m["model.blocks.3.attn.w"].item<float>(), 4.0f);
}

TEST(module_target, ignored_names_are_accepted_and_not_loaded) {
  model m({{"w", at::zeros({2})}});
  module_target target(m.tensors, {.ignore = {"rotary_emb\\.inv_freq$"}});
  EXPECT_EQ(target.model_name("layers.0.rotary_emb.inv_freq"), std::nullopt);
  apply(target, {{{"w", at::ones({2})}, {"layers.0.rotary_emb.inv_freq", at::ones({7})}}});
  EXPECT_TRUE(at::equal(m["w"], at::ones({2})));
}

// ---------------------------------------------------------------- fused parameters

// A GQA attention layer and an MLP as vLLM fuses them: q 4 rows, k and v 2 each.
std::vector<named_tensor> fused_model(std::int64_t q_rows = 4, std::int64_t kv_rows = 2, std::int64_t ff_rows = 3) {
  return {{"layers.0.self_attn.qkv_proj.weight", at::zeros({q_rows + 2 * kv_rows, 2})},
          {"layers.0.mlp.gate_up_proj.weight", at::zeros({2 * ff_rows, 2})}};
}

update fused_update(std::int64_t q_rows = 4, std::int64_t kv_rows = 2, std::int64_t ff_rows = 3) {
  return {{{"layers.0.self_attn.v_proj.weight", range(kv_rows, 2, 300)},  // any order
           {"layers.0.self_attn.q_proj.weight", range(q_rows, 2, 100)},
           {"layers.0.self_attn.k_proj.weight", range(kv_rows, 2, 200)},
           {"layers.0.mlp.up_proj.weight", range(ff_rows, 2, 500)},
           {"layers.0.mlp.gate_proj.weight", range(ff_rows, 2, 400)}}};
}

TEST(module_target, stacks_q_k_v_and_gate_up_at_their_offsets_as_vllm_does) {
  model m(fused_model());
  module_target target(m.tensors, {.fused = vllm_stacked_params()});
  EXPECT_EQ(target.model_name("layers.0.self_attn.k_proj.weight"), "layers.0.self_attn.qkv_proj.weight");
  apply(target, fused_update());
  EXPECT_TRUE(at::equal(m["layers.0.self_attn.qkv_proj.weight"],
                        at::cat({range(4, 2, 100), range(2, 2, 200), range(2, 2, 300)})));
  EXPECT_TRUE(at::equal(m["layers.0.mlp.gate_up_proj.weight"], at::cat({range(3, 2, 400), range(3, 2, 500)})));
}

TEST(module_target, a_fused_mapping_is_used_only_where_the_model_has_the_fused_tensor) {
  model m({{"vision.q_proj.weight", at::zeros({2, 2})}});
  module_target target(m.tensors, {.fused = vllm_stacked_params()});
  EXPECT_EQ(target.model_name("vision.q_proj.weight"), "vision.q_proj.weight");
  apply(target, {{{"vision.q_proj.weight", range(2, 2)}}});
  EXPECT_TRUE(at::equal(m["vision.q_proj.weight"], range(2, 2)));
}

TEST(module_target, a_missing_fused_component_is_refused_by_name) {
  model m(fused_model());
  module_target target(m.tensors, {.fused = vllm_stacked_params()});
  update u = fused_update();
  u.tensors.erase(u.tensors.begin() + 2);  // k_proj
  auto e = REFIT_THROWN(target.begin_update(u.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(),
            "module_target: the update misses component '.k_proj' of fused model tensor "
            "'layers.0.self_attn.qkv_proj.weight'");
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, fused_components_that_do_not_fill_the_fused_tensor_are_refused) {
  model m(fused_model(/*q_rows=*/4, /*kv_rows=*/1));  // qkv has 6 rows
  module_target target(m.tensors, {.fused = vllm_stacked_params()});
  auto e = REFIT_THROWN(target.begin_update(fused_update().metadata()));  // k, v with 2 rows
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("the components of fused model tensor 'layers.0.self_attn.qkv_proj.weight' "
                                     "stack to 4 (.q_proj) + 2 (.k_proj) + 2 (.v_proj) = 8 rows on this rank, the "
                                     "model tensor has 6"));
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, a_fused_component_must_match_beyond_dim_0) {
  model m(fused_model());
  module_target target(m.tensors, {.fused = vllm_stacked_params()});
  update u = fused_update();
  u.tensors[1].second = range(4, 3);  // q_proj with 3 columns
  auto e = REFIT_THROWN(target.begin_update(u.metadata()));
  EXPECT_THAT(e.message(), HasSubstr("shapes of update tensor 'layers.0.self_attn.q_proj.weight' (model name "
                                     "'layers.0.self_attn.qkv_proj.weight') [4, 3] and model tensor "
                                     "'layers.0.self_attn.qkv_proj.weight' [8, 2] do not match (beyond dim 0)"));
}

TEST(module_target, a_fused_component_given_twice_is_refused) {
  model m({{"l.qkv_proj", at::zeros({3, 1})}});
  module_target target(m.tensors, {.renames = {rename_rule::regex("^(a|b)\\.", "l.")},
                                   .fused = {{".qkv_proj", {".q_proj", ".k_proj", ".v_proj"}, {}}}});
  update u{{{"a.q_proj", at::ones({1, 1})},
            {"b.q_proj", at::ones({1, 1})},
            {"l.k_proj", at::ones({1, 1})},
            {"l.v_proj", at::ones({1, 1})}}};
  auto e = REFIT_THROWN(target.begin_update(u.metadata()));
  EXPECT_THAT(e.message(), HasSubstr("update tensors 'a.q_proj' and 'b.q_proj' both load into component '.q_proj' "
                                     "of model tensor 'l.qkv_proj'"));
}

TEST(module_target, declared_component_sizes_place_a_partial_update_of_a_fused_tensor) {
  model m(fused_model());
  auto fused = vllm_stacked_params();
  fused[0].sizes = {4, 2, 2};
  module_target target(m.tensors, {.fused = fused, .require_complete = false});
  apply(target, {{{"layers.0.self_attn.v_proj.weight", range(2, 2, 300)}}});
  at::Tensor qkv = m["layers.0.self_attn.qkv_proj.weight"];
  EXPECT_TRUE(at::equal(qkv.narrow(0, 6, 2), range(2, 2, 300)));
  EXPECT_TRUE(at::equal(qkv.narrow(0, 0, 6), at::zeros({6, 2})));

  auto wrong =
      REFIT_THROWN(target.begin_update(update{{{"layers.0.self_attn.k_proj.weight", range(3, 2)}}}.metadata()));
  EXPECT_THAT(wrong.message(), HasSubstr("update tensor 'layers.0.self_attn.k_proj.weight' gives 3 rows of component "
                                         "'.k_proj' of model tensor 'layers.0.self_attn.qkv_proj.weight', its declared "
                                         "size makes 2"));
}

TEST(module_target, a_partial_update_of_a_fused_tensor_needs_declared_sizes) {
  model m(fused_model());
  module_target target(m.tensors, {.fused = vllm_stacked_params(), .require_complete = false});
  auto e = REFIT_THROWN(target.begin_update(update{{{"layers.0.self_attn.k_proj.weight", range(2, 2)}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("carries only some components of fused model tensor "
                                     "'layers.0.self_attn.qkv_proj.weight' (not '.q_proj'); set fused_param::sizes"));
  EXPECT_TRUE(m.untouched());
}

// ---------------------------------------------------------------- tensor parallelism

TEST(module_target, column_parallel_keeps_this_ranks_rows) {
  model m({{"up.weight", at::zeros({2, 3})}, {"up.bias", at::zeros({2})}});
  module_target target(m.tensors, {.shards = {{"^up\\.", parallel_style::column}}, .tp_rank = 1, .tp_size = 2});
  apply(target, {{{"up.weight", range(4, 3)}, {"up.bias", at::arange(4, at::kFloat)}}});
  EXPECT_TRUE(at::equal(m["up.weight"], range(4, 3).narrow(0, 2, 2)));
  EXPECT_TRUE(at::equal(m["up.bias"], at::tensor({2.0f, 3.0f})));
}

TEST(module_target, row_parallel_keeps_this_ranks_columns_and_the_whole_bias) {
  model m({{"down.weight", at::zeros({3, 2})}, {"down.bias", at::zeros({3})}});
  module_target target(m.tensors, {.shards = {{"^down\\.", parallel_style::row}}, .tp_rank = 1, .tp_size = 2});
  apply(target, {{{"down.weight", range(3, 4)}, {"down.bias", at::arange(3, at::kFloat)}}});
  EXPECT_TRUE(at::equal(m["down.weight"], range(3, 4).narrow(1, 2, 2)));
  EXPECT_TRUE(at::equal(m["down.bias"], at::arange(3, at::kFloat))) << "vLLM's row-parallel bias is replicated";
}

TEST(module_target, the_first_matching_shard_rule_wins_and_unmatched_tensors_are_replicated) {
  model m({{"a.w", at::zeros({1, 2})}, {"b.w", at::zeros({2, 2})}});
  module_target target(
      m.tensors, {.shards = {{"^a", parallel_style::column}, {"w$", parallel_style::row}}, .tp_rank = 0, .tp_size = 2});
  apply(target, {{{"a.w", range(2, 2)}, {"b.w", range(2, 4)}}});
  EXPECT_TRUE(at::equal(m["a.w"], range(1, 2)));
  EXPECT_TRUE(at::equal(m["b.w"], range(2, 4).narrow(1, 0, 2)));

  model r({{"norm.weight", at::zeros({4})}});
  module_target replicated(r.tensors, {.shards = {{"proj", parallel_style::column}}, .tp_rank = 1, .tp_size = 2});
  apply(replicated, {{{"norm.weight", at::ones({4})}}});
  EXPECT_TRUE(at::equal(r["norm.weight"], at::ones({4})));
}

TEST(module_target, a_split_dimension_not_divisible_by_tp_size_is_refused) {
  model m({{"up.weight", at::zeros({1, 3})}});
  module_target target(m.tensors, {.shards = {{"up", parallel_style::column}}, .tp_rank = 0, .tp_size = 3});
  auto e = REFIT_THROWN(target.begin_update(update{{{"up.weight", range(4, 3)}}}.metadata()));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(),
            "module_target: update tensor 'up.weight' [4, 3] is column-parallel but its dim 0 (4) is "
            "not divisible by tp_size 3");
  EXPECT_TRUE(m.untouched());
}

TEST(module_target, a_shard_that_does_not_fit_names_the_ranks_shape) {
  model m({{"down.weight", at::zeros({3, 2})}});
  module_target target(m.tensors, {.shards = {{"down", parallel_style::row}}, .tp_rank = 0, .tp_size = 2});
  auto e = REFIT_THROWN(target.begin_update(update{{{"down.weight", range(3, 8)}}}.metadata()));
  EXPECT_EQ(e.message(),
            "module_target: shapes of update tensor 'down.weight' [3, 8] and model tensor 'down.weight' "
            "[3, 2] (rank 0 of 2 holds [3, 4]) do not match");
}

TEST(module_target, a_column_parallel_scalar_is_refused) {
  model m({{"scale", at::zeros({})}});
  module_target target(m.tensors, {.shards = {{"scale", parallel_style::column}}, .tp_rank = 0, .tp_size = 2});
  auto e = REFIT_THROWN(target.begin_update(update{{{"scale", at::ones({})}}}.metadata()));
  EXPECT_THAT(e.message(), HasSubstr("update tensor 'scale' is a scalar and cannot be column-parallel"));
}

TEST(module_target, fused_and_column_parallel_shards_each_component_then_stacks_the_shards) {
  // q 8 rows, k and v 4 rows each (GQA); tp 2: this rank holds q[4:8], k[2:4], v[2:4].
  model m(fused_model(/*q_rows=*/4, /*kv_rows=*/2, /*ff_rows=*/3));
  module_target target(m.tensors, {.fused = vllm_stacked_params(),
                                   .shards = {{"qkv_proj|gate_up_proj", parallel_style::column}},
                                   .tp_rank = 1,
                                   .tp_size = 2});
  update full = fused_update(/*q_rows=*/8, /*kv_rows=*/4, /*ff_rows=*/6);
  apply(target, full);
  EXPECT_TRUE(at::equal(
      m["layers.0.self_attn.qkv_proj.weight"],
      at::cat({range(8, 2, 100).narrow(0, 4, 4), range(4, 2, 200).narrow(0, 2, 2), range(4, 2, 300).narrow(0, 2, 2)})));
  EXPECT_TRUE(at::equal(m["layers.0.mlp.gate_up_proj.weight"],
                        at::cat({range(6, 2, 400).narrow(0, 3, 3), range(6, 2, 500).narrow(0, 3, 3)})));
}

TEST(module_target, fused_declared_sizes_are_sharded_too) {
  model m(fused_model(/*q_rows=*/4, /*kv_rows=*/2));
  auto fused = vllm_stacked_params();
  fused[0].sizes = {8, 4, 4};
  module_target target(m.tensors, {.fused = fused,
                                   .shards = {{"qkv_proj", parallel_style::column}},
                                   .tp_rank = 0,
                                   .tp_size = 2,
                                   .require_complete = false});
  apply(target, {{{"layers.0.self_attn.k_proj.weight", range(4, 2, 200)}}});
  EXPECT_TRUE(at::equal(m["layers.0.self_attn.qkv_proj.weight"].narrow(0, 4, 2), range(2, 2, 200)));
}

TEST(module_target, vllm_llama_shards_split_a_decoder_layer_as_vllm_does) {
  model m({{"layers.0.self_attn.qkv_proj.weight", at::zeros({4, 4})},
           {"layers.0.self_attn.o_proj.weight", at::zeros({4, 2})},
           {"layers.0.mlp.gate_up_proj.weight", at::zeros({6, 4})},
           {"layers.0.mlp.down_proj.weight", at::zeros({4, 3})},
           {"layers.0.input_layernorm.weight", at::zeros({4})}});
  module_target target(m.tensors,
                       {.fused = vllm_stacked_params(), .shards = vllm_llama_shards(), .tp_rank = 1, .tp_size = 2});
  update u{{{"layers.0.self_attn.q_proj.weight", range(4, 4, 100)},
            {"layers.0.self_attn.k_proj.weight", range(2, 4, 200)},
            {"layers.0.self_attn.v_proj.weight", range(2, 4, 300)},
            {"layers.0.self_attn.o_proj.weight", range(4, 4, 400)},
            {"layers.0.mlp.gate_proj.weight", range(6, 4, 500)},
            {"layers.0.mlp.up_proj.weight", range(6, 4, 600)},
            {"layers.0.mlp.down_proj.weight", range(4, 6, 700)},
            {"layers.0.input_layernorm.weight", at::ones({4})}}};
  apply(target, u);
  EXPECT_TRUE(at::equal(
      m["layers.0.self_attn.qkv_proj.weight"],
      at::cat({range(4, 4, 100).narrow(0, 2, 2), range(2, 4, 200).narrow(0, 1, 1), range(2, 4, 300).narrow(0, 1, 1)})));
  EXPECT_TRUE(at::equal(m["layers.0.self_attn.o_proj.weight"], range(4, 4, 400).narrow(1, 2, 2)));
  EXPECT_TRUE(at::equal(m["layers.0.mlp.gate_up_proj.weight"],
                        at::cat({range(6, 4, 500).narrow(0, 3, 3), range(6, 4, 600).narrow(0, 3, 3)})));
  EXPECT_TRUE(at::equal(m["layers.0.mlp.down_proj.weight"], range(4, 6, 700).narrow(1, 3, 3)));
  EXPECT_TRUE(at::equal(m["layers.0.input_layernorm.weight"], at::ones({4})));
}

TEST(module_target, vocab_parallel_embeddings_hold_their_padded_rows_as_the_layout_places_them) {
  // vocab 100 padded to 128 for tp 2: rank 1 holds rows [64, 128), of which [64, 100)
  // are the vocabulary and the rest padding the update never writes.
  model m({{"model.embed_tokens.weight", at::full({64, 2}, -1.0)}});
  auto rules = vllm_vocab_shards();
  module_target target(m.tensors, {.shards = rules, .tp_rank = 1, .tp_size = 2});
  apply(target, {{{"model.embed_tokens.weight", range(100, 2, 0)}}});
  EXPECT_TRUE(at::equal(m["model.embed_tokens.weight"].narrow(0, 0, 36), range(100, 2, 0).narrow(0, 64, 36)));
  EXPECT_TRUE(at::equal(m["model.embed_tokens.weight"].narrow(0, 36, 28), at::full({28, 2}, -1.0)));
  // The core's layout (what sharded transfers plan with) places the same rows.
  tp_layout_options o;
  o.shards = rules;
  const auto layout = tensor_parallel_layout({{{"model.embed_tokens.weight", dtype::float32, {100, 2}}}}, 2, 1, o);
  ASSERT_EQ(layout.tensors.size(), 1u);
  EXPECT_EQ(layout.tensors[0].spec.shape, (std::vector<std::int64_t>{64, 2}));
  ASSERT_EQ(layout.tensors[0].pieces.size(), 1u);
  EXPECT_EQ(layout.tensors[0].pieces[0].from, (box{{64, 0}, {36, 2}}));
  EXPECT_EQ(layout.tensors[0].pieces[0].at, (std::vector<std::int64_t>{0, 0}));
}

// ---------------------------------------------------------------- construction

TEST(module_target, bad_options_and_model_tensors_are_refused_at_construction) {
  std::vector<named_tensor> t{{"w", at::zeros({1})}};
  auto rank = REFIT_THROWN(module_target(t, {.tp_rank = 2, .tp_size = 2}));
  EXPECT_EQ(rank.kind(), errc::invalid_argument);
  EXPECT_THAT(rank.message(), HasSubstr("tp_rank 2 is not in [0, tp_size 2)"));

  auto regex = REFIT_THROWN(module_target(t, {.ignore = {"(unclosed"}}));
  EXPECT_EQ(regex.kind(), errc::invalid_argument);
  EXPECT_THAT(regex.message(), HasSubstr("ignore pattern '(unclosed' is not a valid regular expression"));

  auto sizes = REFIT_THROWN(module_target(t, {.fused = {{"qkv", {"q", "k", "v"}, {1, 2}}}}));
  EXPECT_THAT(sizes.message(), HasSubstr("fused parameter 'qkv' has 3 components but 2 sizes"));

  auto twice = REFIT_THROWN(module_target({{"w", at::zeros({1})}, {"w", at::zeros({1})}}));
  EXPECT_THAT(twice.message(), HasSubstr("model tensor name 'w' appears twice"));

  auto undefined = REFIT_THROWN(module_target({{"u", at::Tensor()}}));
  EXPECT_THAT(undefined.message(), HasSubstr("model tensor 'u' is undefined"));
}

}  // namespace
}  // namespace refit::libtorch
