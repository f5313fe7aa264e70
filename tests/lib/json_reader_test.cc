#include <refit/json_reader.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

json parse(const char* text) { return json::parse(text); }

TEST(parse_json_text, parses_valid_text) {
  json j = parse_json_text(R"({"a": [1, 2], "b": "x"})", "tcp init_info");
  EXPECT_EQ(j["a"][1], 2);
  EXPECT_EQ(j["b"], "x");
}

TEST(parse_json_text, malformed_text_names_context_and_offset) {
  auto e = REFIT_THROWN(parse_json_text(R"({"a": 1,})", "tcp init_info"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), StartsWith("tcp init_info: malformed JSON at byte 9"));
  e = REFIT_THROWN(parse_json_text("", "ctl"));
  EXPECT_THAT(e.message(), StartsWith("ctl: malformed JSON at byte"));
}

// Found writing tests/fuzz: nlohmann reports a number too large for a double as
// out_of_range, not parse_error; it escaped as a non-refit exception (from
// frame_stream::read it skipped the control client's clean-up, so its pending calls
// waited for their deadlines instead of failing).
TEST(parse_json_text, number_out_of_range_is_malformed_json) {
  auto e = REFIT_THROWN(parse_json_text(R"({"a": 1e999})", "tcp init_info"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), StartsWith("tcp init_info: malformed JSON"));
  EXPECT_THAT(e.message(), HasSubstr("1e999"));
}

// Found writing tests/fuzz: copying or dumping a json value recurses per level;
// 100k nested brackets (200 KB of text) overflowed the stack of whoever copied the
// parsed value (the worker host copies a request's params).
TEST(parse_json_text, nesting_deeper_than_the_limit_is_refused) {
  auto nested = [](std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_NO_THROW(parse_json_text(nested(max_json_depth), "ctl"));
  auto e = REFIT_THROWN(parse_json_text(nested(max_json_depth + 1), "ctl"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("nests deeper than 64 levels"));
  EXPECT_NO_THROW(parse_json_text(R"({"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"[["})",
                                  "brackets in strings do not count"));
  e = REFIT_THROWN(parse_json_text(nested(100000), "ctl"));
  EXPECT_THAT(e.message(), HasSubstr("nests deeper"));
}

// Found by tests/fuzz/info_fuzz: nlohmann's parse_error message quotes the input
// where it stopped ("last read: '\xff'"); an error message that is not valid UTF-8
// cannot be sent in a control answer (dump() throws type_error 316).
TEST(parse_json_text, malformed_text_message_is_valid_utf8) {
  auto e = REFIT_THROWN(parse_json_text("{\"a\": 1, \"\xff\xff\": 2}", "ctl"));
  EXPECT_THAT(e.message(), StartsWith("ctl: malformed JSON at byte"));
  EXPECT_NO_THROW((void)json(e.message()).dump()) << e.message();
}

TEST(valid_utf8, keeps_well_formed_sequences_and_replaces_the_rest) {
  EXPECT_EQ(valid_utf8("plain \t ascii"), "plain \t ascii");
  EXPECT_EQ(valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"), "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  EXPECT_EQ(valid_utf8("a\xff"
                       "b"),
            "a?b");
  EXPECT_EQ(valid_utf8("\xc3"), "?");                 // truncated
  EXPECT_EQ(valid_utf8("\xc0\xaf"), "??");            // overlong '/'
  EXPECT_EQ(valid_utf8("\xed\xa0\x80"), "???");       // a surrogate
  EXPECT_EQ(valid_utf8("\xf4\x90\x80\x80"), "????");  // above U+10FFFF
  std::string all;
  for (int c = 0; c < 256; ++c) all += static_cast<char>(c);
  EXPECT_NO_THROW((void)json(valid_utf8(all)).dump());
}

TEST(json_nesting_depth, counts_arrays_and_objects_outside_strings) {
  EXPECT_EQ(json_nesting_depth("1"), 0u);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": []}], "c": {}})"), 4u);
  EXPECT_EQ(json_nesting_depth(R"(["]]]\"[[[", ["x"]])"), 2u);
  // Stops counting once past the limit it was given.
  EXPECT_EQ(json_nesting_depth(std::string(1000, '['), 10), 11u);
}

// Found writing tests/fuzz: the excerpt was cut at byte 37, which can split a UTF-8
// character; the worker host's answer carrying the message then failed to serialize
// (nlohmann type_error 316) and was never sent: the call waited for its deadline.
TEST(describe_json, excerpt_is_valid_utf8_and_bounded) {
  std::string text;
  for (int i = 0; i < 30; ++i) text += "\xc3\xa9";  // é, two bytes each
  for (const json& v : {json(text), json::array({text}), json{{"k", text}}, json{{text, 1}}}) {
    std::string d = describe_json(v);
    EXPECT_THAT(d, EndsWith("..."));
    EXPECT_LE(d.size(), std::string(v.type_name()).size() + 1 + 40);
    EXPECT_NO_THROW((void)json(d).dump()) << d;
  }
  // Bounded work and recursion for a value of any depth (not built from text, so not
  // limited by max_json_depth).
  json deep = json::array();
  json* inner = &deep;
  for (int i = 0; i < 200000; ++i) {
    inner->push_back(json::array());
    inner = &inner->back();
  }
  EXPECT_EQ(describe_json(deep), "array " + std::string(37, '[') + "...");
}

TEST(describe_json, names_the_type_and_an_excerpt) {
  EXPECT_EQ(describe_json(json("abc")), "string \"abc\"");
  EXPECT_EQ(describe_json(json(5)), "number 5");
  EXPECT_EQ(describe_json(json(nullptr)), "null null");
  EXPECT_EQ(describe_json(parse("[1,2]")), "array [1,2]");
  std::string long_text(100, 'x');
  std::string d = describe_json(json(long_text));
  EXPECT_THAT(d, StartsWith("string \"xxx"));
  EXPECT_THAT(d, EndsWith("..."));
  EXPECT_EQ(d.size(), std::string("string ").size() + 40);
}

TEST(json_reader, reads_members_of_every_supported_type) {
  json j = parse(R"({"flag": true, "n": -3, "u": 7, "x": 1.5, "xi": 2, "s": "hi",
                     "v": [1, 2, 3], "vv": [[1], [], [2, 3]], "vs": ["a", "b"], "raw": {"k": [1]}})");
  json_reader r(j, "ctx");
  EXPECT_EQ(r.required<bool>("flag"), true);
  EXPECT_EQ(r.required<int>("n"), -3);
  EXPECT_EQ(r.required<std::uint32_t>("u"), 7u);
  EXPECT_DOUBLE_EQ(r.required<double>("x"), 1.5);
  EXPECT_DOUBLE_EQ(r.required<double>("xi"), 2.0);  // an integer is a number
  EXPECT_EQ(r.required<std::string>("s"), "hi");
  EXPECT_EQ(r.required<std::vector<std::int64_t>>("v"), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(r.required<std::vector<std::vector<int>>>("vv"), (std::vector<std::vector<int>>{{1}, {}, {2, 3}}));
  EXPECT_EQ(r.required<std::vector<std::string>>("vs"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r.required<json>("raw"), parse(R"({"k": [1]})"));
  EXPECT_NO_THROW(r.finish());
}

TEST(json_reader, missing_required_member_names_context_and_path) {
  json j = parse(R"({"wire": {}})");
  json_reader r(j, "tcp init_info");
  auto e = REFIT_THROWN(r.required<std::string>("host"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "tcp init_info: missing required member 'host'");
  json_reader w = r.object("wire");
  e = REFIT_THROWN(w.required<int>("port"));
  EXPECT_EQ(e.message(), "tcp init_info: missing required member 'wire.port'");
}

TEST(json_reader, mistyped_members_say_what_was_expected_and_what_came) {
  json j = parse(R"({"i": "5", "b": 1, "s": 5, "a": {"x": 1}, "d": "1.0", "f": 1.5, "t": true})");
  json_reader r(j, "shm update_info");
  auto e = REFIT_THROWN(r.required<int>("i"));
  EXPECT_EQ(e.message(), "shm update_info: member 'i' expected an integer, got string \"5\"");
  e = REFIT_THROWN(r.required<bool>("b"));
  EXPECT_EQ(e.message(), "shm update_info: member 'b' expected a boolean, got number 1");
  e = REFIT_THROWN(r.required<std::string>("s"));
  EXPECT_EQ(e.message(), "shm update_info: member 's' expected a string, got number 5");
  e = REFIT_THROWN(r.required<std::vector<int>>("a"));
  EXPECT_EQ(e.message(), "shm update_info: member 'a' expected an array, got object {\"x\":1}");
  e = REFIT_THROWN(r.required<double>("d"));
  EXPECT_EQ(e.message(), "shm update_info: member 'd' expected a number, got string \"1.0\"");
  // Strict: a fractional number and a boolean are not integers.
  e = REFIT_THROWN(r.required<std::int64_t>("f"));
  EXPECT_EQ(e.message(), "shm update_info: member 'f' expected an integer, got number 1.5");
  e = REFIT_THROWN(r.required<std::uint64_t>("t"));
  EXPECT_EQ(e.message(), "shm update_info: member 't' expected an integer, got boolean true");
}

TEST(json_reader, array_element_errors_name_the_element_path) {
  json j = parse(R"({"meta": {"shapes": [[1, 2], [3, "4"]]}})");
  json_reader r(j, "loopback update_info");
  json_reader meta = r.object("meta");
  auto e = REFIT_THROWN(meta.required<std::vector<std::vector<std::int64_t>>>("shapes"));
  EXPECT_EQ(e.message(), "loopback update_info: member 'meta.shapes[1][1]' expected an integer, got string \"4\"");
}

TEST(json_reader, integer_ranges_are_checked_per_target_type) {
  json j = parse(R"({"u8ok": 255, "u8big": 256, "i8lo": -128, "i8under": -129, "i8over": 128,
                     "neg": -1, "u64max": 18446744073709551615, "i64over": 9223372036854775808,
                     "i64min": -9223372036854775808, "i32over": 2147483648, "i32under": -2147483649})");
  json_reader r(j, "ctx");
  EXPECT_EQ(r.required<std::uint8_t>("u8ok"), 255);
  auto e = REFIT_THROWN(r.required<std::uint8_t>("u8big"));
  EXPECT_EQ(e.message(), "ctx: member 'u8big' is 256, above the maximum 255");
  EXPECT_EQ(r.required<std::int8_t>("i8lo"), -128);
  e = REFIT_THROWN(r.required<std::int8_t>("i8under"));
  EXPECT_EQ(e.message(), "ctx: member 'i8under' is -129, out of range");
  e = REFIT_THROWN(r.required<std::int8_t>("i8over"));
  EXPECT_EQ(e.message(), "ctx: member 'i8over' is 128, above the maximum 127");
  e = REFIT_THROWN(r.required<std::uint32_t>("neg"));
  EXPECT_EQ(e.message(), "ctx: member 'neg' must not be negative, got -1");
  e = REFIT_THROWN(r.required<std::size_t>("neg"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(r.required<std::uint64_t>("u64max"), std::numeric_limits<std::uint64_t>::max());
  e = REFIT_THROWN(r.required<std::int64_t>("i64over"));
  EXPECT_EQ(e.message(), "ctx: member 'i64over' is 9223372036854775808, above the maximum 9223372036854775807");
  EXPECT_EQ(r.required<std::int64_t>("i64min"), std::numeric_limits<std::int64_t>::min());
  e = REFIT_THROWN(r.required<std::int32_t>("i32over"));
  EXPECT_THAT(e.message(), HasSubstr("above the maximum 2147483647"));
  e = REFIT_THROWN(r.required<std::int32_t>("i32under"));
  EXPECT_EQ(e.message(), "ctx: member 'i32under' is -2147483649, out of range");
  // Unsigned targets also reject negatives inside arrays, with the element path.
  json k = parse(R"({"sizes": [1, -2]})");
  json_reader rk(k, "ctx");
  e = REFIT_THROWN(rk.required<std::vector<std::uint64_t>>("sizes"));
  EXPECT_EQ(e.message(), "ctx: member 'sizes[1]' must not be negative, got -2");
}

TEST(json_reader, optional_and_maybe_treat_absent_and_null_alike) {
  json j = parse(R"({"present": 4, "nul": null, "bad": "x"})");
  json_reader r(j, "ctx");
  EXPECT_EQ(r.optional<int>("present", 9), 4);
  EXPECT_EQ(r.optional<int>("absent", 9), 9);
  EXPECT_EQ(r.optional<int>("nul", 9), 9);
  EXPECT_EQ(r.maybe<int>("present"), 4);
  EXPECT_EQ(r.maybe<int>("absent"), std::nullopt);
  EXPECT_EQ(r.maybe<int>("nul"), std::nullopt);
  // Present with the wrong type is an error even for optional members.
  auto e = REFIT_THROWN(r.optional<int>("bad", 1));
  EXPECT_EQ(e.message(), "ctx: member 'bad' expected an integer, got string \"x\"");
  e = REFIT_THROWN(r.maybe<bool>("bad"));
  EXPECT_THAT(e.message(), HasSubstr("expected a boolean"));
  EXPECT_NO_THROW(r.finish());
}

TEST(json_reader, has_marks_the_member_read) {
  json j = parse(R"({"a": 1, "n": null})");
  json_reader r(j, "ctx");
  EXPECT_TRUE(r.has("a"));
  EXPECT_FALSE(r.has("n"));
  EXPECT_FALSE(r.has("zzz"));
  EXPECT_NO_THROW(r.finish());
}

TEST(json_reader, finish_names_the_unknown_member_and_lists_accepted_ones) {
  json j = parse(R"({"host": "h", "prot": 80})");
  json_reader r(j, "tcp init_info");
  r.required<std::string>("host");
  r.optional<int>("port", 0);  // asked but absent: still accepted
  auto e = REFIT_THROWN(r.finish());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "tcp init_info: unknown member 'prot' (accepted: host, port)");
}

TEST(json_reader, finish_with_nothing_read_has_no_accepted_list) {
  json j = parse(R"({"x": 1})");
  json_reader r(j, "ctx");
  auto e = REFIT_THROWN(r.finish());
  EXPECT_EQ(e.message(), "ctx: unknown member 'x'");
}

TEST(json_reader, nested_finish_names_the_full_path) {
  json j = parse(R"({"wire": {"buffer_bytes": 4096, "num_bufers": 2}})");
  json_reader r(j, "tcp init_info");
  json_reader w = r.object("wire");
  w.optional<std::uint64_t>("buffer_bytes", 0);
  w.optional<std::uint32_t>("num_buffers", 0);
  EXPECT_NO_THROW(r.finish());  // the outer object only knows "wire"
  auto e = REFIT_THROWN(w.finish());
  EXPECT_EQ(e.message(), "tcp init_info: unknown member 'wire.num_bufers' (accepted: buffer_bytes, num_buffers)");
}

TEST(json_reader, non_objects_are_rejected_with_what_came) {
  json arr = parse("[1]");
  auto e = REFIT_THROWN(json_reader(arr, "tcp init_info"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "tcp init_info: expected a JSON object, got array [1]");
  json j = parse(R"({"wire": 5})");
  json_reader r(j, "tcp init_info");
  e = REFIT_THROWN(r.object("wire"));
  EXPECT_EQ(e.message(), "tcp init_info: member 'wire' expected an object, got number 5");
  e = REFIT_THROWN(r.object("missing"));
  EXPECT_EQ(e.message(), "tcp init_info: missing required member 'missing'");
}

TEST(json_reader, fail_prefixes_the_context) {
  json j = json::object();
  json_reader r(j, "nccl init_info", "group");
  EXPECT_EQ(r.context(), "nccl init_info");
  EXPECT_EQ(r.member_path("rank"), "group.rank");
  auto e = REFIT_THROWN(r.fail("member 'rank' must be below world_size"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "nccl init_info: member 'rank' must be below world_size");
}

}  // namespace
}  // namespace refit
