"""Which Bazel test targets skipped, and why: Bazel reports a GoogleTest binary whose
tests all called GTEST_SKIP as PASSED; its test.xml says otherwise. CI (.ci/run)
runs this after each `bazel test` so that its closing line counts those targets
as skipped, not passed, and the log shows each one's reason.

  python3 tests/codebase/skipped_tests.py TESTLOGS_DIR [--label CONFIG]

Prints one line per target with a skipped test:
  skipped-target: //tests/cuda:raii_test (8 of 8 tests) [cuda]: no CUDA device: ...
  partly-skipped: //tests/x:y_test (1 of 12 tests) [cuda]: reason
and a last line "skipped targets: N". Standard library only."""

import argparse
import os
import sys
import xml.etree.ElementTree as ET


def target_of(testlogs, xml_path):
    """bazel-testlogs/tests/cuda/raii_test/test.xml -> //tests/cuda:raii_test
    (sharded or repeated runs: .../raii_test/shard_1_of_2/test.xml)."""
    rel = os.path.relpath(os.path.dirname(xml_path), testlogs).split(os.sep)
    while rel and (rel[-1].startswith("shard_") or rel[-1].startswith("run_")):
        rel.pop()
    return "//%s:%s" % ("/".join(rel[:-1]), rel[-1])


def read(xml_path):
    """(tests, skipped, first reason) of one gtest XML file; None if it is not one."""
    try:
        root = ET.parse(xml_path).getroot()
    except (ET.ParseError, OSError):
        return None
    tests = skipped = 0
    reason = ""
    for case in root.iter("testcase"):
        tests += 1
        node = case.find("skipped")
        if case.get("result") == "skipped" or node is not None:
            skipped += 1
            if not reason and node is not None:
                text = (node.get("message") or node.text or "").strip()
                # gtest: "file.cc:12\nthe reason"; keep the reason.
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                reason = lines[-1] if lines else ""
    return tests, skipped, reason


def main():
    p = argparse.ArgumentParser()
    p.add_argument("testlogs")
    p.add_argument("--label", default="")
    args = p.parse_args()
    found = {}
    for root, _, files in os.walk(args.testlogs, followlinks=True):
        if "test.xml" in files:
            path = os.path.join(root, "test.xml")
            got = read(path)
            if got is None:
                continue
            t = target_of(args.testlogs, path)
            tests, skipped, reason = found.get(t, (0, 0, ""))
            found[t] = (tests + got[0], skipped + got[1], reason or got[2])
    label = " [%s]" % args.label if args.label else ""
    whole = 0
    for t in sorted(found):
        tests, skipped, reason = found[t]
        if not skipped:
            continue
        kind = "skipped-target" if skipped == tests else "partly-skipped"
        whole += kind == "skipped-target"
        print("%s: %s (%d of %d tests)%s: %s" % (kind, t, skipped, tests, label, reason or "no reason given"))
    print("skipped targets: %d%s" % (whole, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
