"""The GPU check's report (tests/cuda/gpu_check.sh): classifies each step from its
exit status and its log, writes summary.json and prints a table.

  gpu_report.py summarize --report DIR --mode gpu|dry [--dry-reason R] --budget S --elapsed S
  gpu_report.py verify-dry-run OUT_DIR [--max-seconds 120]

  gpu_report.py verified-backends REPORT.json...

A step's status is one of gpu_report_schema.json's (the one schema this file, the
README's status table and CI's synthetic-report test read): "passed", "failed",
"timeout", "skipped" (with the reason it gave), "needs 2 GPUs" (a gtest_2gpu step
on a machine with fewer) or "not run (budget)". On a GPU machine a skip fails the
check and "needs 2 GPUs" is neither a pass nor a failure; in a dry run (no GPU) a
GPU step must skip with a reason, and nothing may fail. verify-dry-run is what CI
runs on the dry run's output: the report is there (at most 3 files), parses, and
says what it should. verified-backends prints what the status table's last
column says of each backend the reports name. Standard library only."""

import argparse
import json
import os
import re
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "gpu_report_schema.json")) as _f:
    SCHEMA = json.load(_f)
PASSED, FAILED, TIMEOUT, SKIPPED, NEEDS_2_GPUS, NOT_RUN = (
    "passed", "failed", "timeout", "skipped", "needs 2 GPUs", "not run (budget)")
assert set(SCHEMA["statuses"]) == {PASSED, FAILED, TIMEOUT, SKIPPED, NEEDS_2_GPUS, NOT_RUN}, SCHEMA["statuses"]
assert SCHEMA["verified_status"] == PASSED

# Step kinds (gpu_steps.txt): gtest needs a GPU; gtest_cpu also runs without one;
# gtest_2gpu needs two.
GTEST_KINDS = ("gtest", "gtest_cpu", "gtest_2gpu")
assert set(SCHEMA["kinds"]) == set(GTEST_KINDS) | {"preflight", "json"}
TIMEOUT_CODES = (124, 137)
NEEDS_2_GPUS_REASON = "needs 2 GPUs"


def read_log(path, limit=4 << 20):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    if len(data) > limit:
        data = data[: limit // 2] + b"\n...\n" + data[-limit // 2:]
    return data.decode("utf-8", "replace")


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def loader_failure(text):
    m = re.search(r"error while loading shared libraries: [^\n]*", text)
    return m.group(0) if m else None


def gtest_skip_reasons(text):
    """gtest prints 'file:line: Skipped' and then the message on the next lines."""
    lines = text.splitlines()
    reasons = []
    for i, line in enumerate(lines):
        if line.rstrip().endswith(": Skipped") and i + 1 < len(lines):
            reason = lines[i + 1].strip()
            if reason and not reason.startswith("["):
                reasons.append(reason)
    return reasons


def classify(kind, state, rc, text):
    """(status, reason, figures) of one step."""
    if state == "not_run":
        return NOT_RUN, "the budget ran out before this step", None
    if rc in TIMEOUT_CODES:
        return TIMEOUT, "killed at its time limit (rc %d)" % rc, None
    broken = loader_failure(text)
    if broken:
        return FAILED, broken, None
    if kind == "preflight":
        missing = [l for l in text.splitlines() if l.startswith("ldd_missing:") or "FAILED" in l
                   or l.startswith("gpu: nvidia-smi failed") or l == "gpu: no nvidia-smi"]
        if rc == 0:
            return PASSED, "", None
        return FAILED, "; ".join(missing) or "exit status %d" % rc, None
    if kind in GTEST_KINDS:
        failed = re.findall(r"^\[  FAILED  \] (\S+)", text, re.M)
        passed = re.search(r"^\[  PASSED  \] (\d+) test", text, re.M)
        skipped = re.search(r"^\[  SKIPPED \] (\d+) test", text, re.M)
        if rc != 0 or failed:
            names = sorted(set(n for n in failed if "." in n))
            return FAILED, ("failed: " + ", ".join(names)) if names else "exit status %d" % rc, None
        if skipped:
            reasons = gtest_skip_reasons(text)
            # A two-GPU step whose every skip says it needs two GPUs: a one-GPU machine.
            if kind == "gtest_2gpu" and reasons and all(r.startswith(NEEDS_2_GPUS_REASON) for r in reasons) \
                    and len(reasons) == int(skipped.group(1)):
                return NEEDS_2_GPUS, reasons[0], None
            return SKIPPED, (reasons[0] if reasons else "skipped without a reason"), None
        if not passed:
            return FAILED, "no gtest summary in the output", None
        return PASSED, passed.group(0).strip("[] ").strip(), None
    if kind == "json":
        value = last_json(text)
        if value is None:
            return FAILED, "exit status %d and no JSON line" % rc if rc else "no JSON line", None
        if value.get("skipped"):
            return SKIPPED, str(value.get("reason") or "skipped without a reason"), value
        if rc != 0:
            return FAILED, str(value.get("error") or value.get("reason") or "exit status %d" % rc), value
        if value.get("error") or value.get("passed") is False:
            return FAILED, str(value.get("error") or "passed: false"), value
        return PASSED, "", value
    return FAILED, "unknown step kind '%s'" % kind, None


def judge(kind, status, reason, mode):
    """Whether a step's status is what the check wants in this mode."""
    if mode == "gpu":
        return status == PASSED or (kind == "gtest_2gpu" and status == NEEDS_2_GPUS)
    # Dry run: GPU steps skip with a reason; steps that need no GPU may pass.
    if kind in ("preflight", "gtest_cpu"):
        return status == PASSED or (kind == "gtest_cpu" and status == SKIPPED and bool(reason))
    return status == SKIPPED and bool(reason) and reason != "skipped without a reason"


def parse_backends(text):
    """gpu_steps.txt's backends column: names separated by commas, "-" for none."""
    text = text.strip()
    return [] if text in ("", "-") else [b.strip() for b in text.split(",") if b.strip()]


def check_summary(summary):
    """Raises ValueError unless `summary` has the schema's fields and statuses."""
    missing = [f for f in SCHEMA["summary_fields"] if f not in summary]
    if missing:
        raise ValueError("summary lacks %s" % missing)
    for s in summary["steps"]:
        missing = [f for f in SCHEMA["step_fields"] if f not in s]
        extra = [f for f in s if f not in SCHEMA["step_fields"] + SCHEMA["optional_step_fields"]]
        if missing or extra:
            raise ValueError("step %s: missing %s, unknown %s" % (s.get("name"), missing, extra))
        if s["status"] not in SCHEMA["statuses"]:
            raise ValueError("step %s: status %r is not one of %s" % (s["name"], s["status"], list(SCHEMA["statuses"])))


def verified_backends(summaries):
    """{backend: "yes" | "yes (1 GPU)" | "no"} over GPU-mode summaries, as the README's
    last column says it (tests/codebase/status_table.cc computes the same from the
    schema): "yes" when a step naming the backend passed and none naming it failed;
    "(1 GPU)" when some of its steps needed two GPUs and had fewer."""
    seen, good, bad, partial = set(), set(), set(), set()
    for summary in summaries:
        if summary.get("mode") != SCHEMA["gpu_mode"]:
            continue
        for s in summary.get("steps", []):
            for b in s.get("backends", []):
                seen.add(b)
                if s["status"] == SCHEMA["verified_status"]:
                    good.add(b)
                elif s["status"] in SCHEMA["failing_statuses"]:
                    bad.add(b)
                elif s["status"] in SCHEMA["neutral_statuses"]:
                    partial.add(b)
    out = {}
    for b in sorted(seen):
        ok = b in good and b not in bad
        out[b] = ("yes (1 GPU)" if b in partial else "yes") if ok else "no"
    return out


def environment(preflight_text):
    env = {}
    for line in preflight_text.splitlines():
        if line.startswith("---- details"):
            break
        m = re.match(r"^([a-zA-Z_]+): (.*)$", line)
        if m:
            key, value = m.group(1), m.group(2).strip()
            env[key] = env[key] + [value] if isinstance(env.get(key), list) else (
                [env[key], value] if key in env else value)
    return env


def summarize(args):
    rep = args.report
    steps = []
    with open(os.path.join(rep, "steps.tsv")) as f:
        rows = [l.rstrip("\n").split("\t") for l in f if l.strip()]
    for name, kind, backends, state, rc, wall, limit in rows:
        code = int(rc) if rc.lstrip("-").isdigit() else None
        text = read_log(os.path.join(rep, "steps", name + ".log"))
        status, reason, figures = classify(kind, state, code, text)
        step = {"name": name, "kind": kind, "backends": parse_backends(backends), "status": status,
                "reason": reason, "rc": code, "wall_s": float(wall), "limit_s": int(limit),
                "ok": judge(kind, status, reason, args.mode)}
        if figures is not None:
            step["result"] = figures
        steps.append(step)
    try:
        with open(os.path.join(rep, "stamp.json")) as f:
            stamp = json.load(f)
    except (OSError, ValueError) as e:
        stamp = {"error": "unreadable stamp: %s" % e}
    pre = next((s for s in steps if s["name"] == "preflight"), None)
    env = environment(read_log(os.path.join(rep, "steps", "preflight.log"))) if pre else {}
    counts = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    ok = bool(steps) and all(s["ok"] for s in steps)
    summary = {"schema": SCHEMA["schema"], "ok": ok, "mode": args.mode, "dry_reason": args.dry_reason or None, "budget_s": args.budget,
               "elapsed_s": args.elapsed, "counts": counts, "stamp": stamp, "environment": env, "steps": steps}
    check_summary(summary)
    with open(os.path.join(rep, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print("GPU check: %s, mode %s%s, %.1f s of %d s budget, commit %s%s" % (
        "OK" if ok else "NOT OK", args.mode, " (%s)" % args.dry_reason if args.dry_reason else "",
        args.elapsed, args.budget, stamp.get("commit", "?"), " (dirty)" if stamp.get("dirty") else ""))
    for s in steps:
        brief = s["reason"]
        if s.get("result") and s["status"] == PASSED:
            brief = json.dumps(s["result"], separators=(",", ":"))
        print("%-4s %-16s %-17s %6.1fs  %s" % ("ok" if s["ok"] else "BAD", s["name"], s["status"], s["wall_s"],
                                              brief[:900]))
    return 0 if ok else 1


EXPECTED_FILES = {"gpu-check.log", "gpu-summary.json", "gpu-report.tar.gz"}


def verify_dry_run(args):
    problems = []
    files = set(os.listdir(args.out))
    if files != EXPECTED_FILES:
        problems.append("report files are %s, expected exactly %s" % (sorted(files), sorted(EXPECTED_FILES)))
    try:
        with open(os.path.join(args.out, "gpu-summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError) as e:
        print("FAIL dry run: no readable summary: %s" % e)
        return 1
    if summary.get("mode") != "dry":
        problems.append("mode is %r, not a dry run" % summary.get("mode"))
    if not summary.get("ok"):
        problems.append("the summary is not ok")
    if summary.get("elapsed_s", 1e9) > args.max_seconds:
        problems.append("took %.1f s, more than %d s" % (summary.get("elapsed_s"), args.max_seconds))
    steps = summary.get("steps", [])
    if not steps or steps[0]["name"] != "preflight" or steps[0]["status"] != PASSED:
        problems.append("the preflight did not run first and pass")
    for s in steps:
        if not s.get("ok"):
            problems.append("step %s: %s (%s)" % (s["name"], s["status"], s["reason"]))
    if not summary.get("stamp", {}).get("commit") or "unknown" in str(summary["stamp"].get("commit")):
        problems.append("the bundle carries no commit stamp")
    try:
        with tarfile.open(os.path.join(args.out, "gpu-report.tar.gz")) as t:
            names = set(t.getnames())
        for s in steps:
            if s["status"] != NOT_RUN and "gpu-report/steps/%s.log" % s["name"] not in names:
                problems.append("the tarball lacks the log of step %s" % s["name"])
    except (OSError, tarfile.TarError) as e:
        problems.append("unreadable tarball: %s" % e)
    for p in problems:
        print("FAIL dry run: " + p)
    if not problems:
        print("dry run OK: %d steps, %s, %.1f s" % (len(steps), summary.get("counts"), summary.get("elapsed_s")))
    return 1 if problems else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--report", required=True)
    s.add_argument("--mode", choices=("gpu", "dry"), required=True)
    s.add_argument("--dry-reason", default="")
    s.add_argument("--budget", type=int, required=True)
    s.add_argument("--elapsed", type=float, required=True)
    v = sub.add_parser("verify-dry-run")
    v.add_argument("out")
    v.add_argument("--max-seconds", type=int, default=120)
    b = sub.add_parser("verified-backends")
    b.add_argument("reports", nargs="+")
    args = p.parse_args()
    if args.cmd == "verified-backends":
        summaries = []
        for path in args.reports:
            with open(path) as f:
                summaries.append(json.load(f))
        for name, said in verified_backends(summaries).items():
            print("%s\t%s" % (name, said))
        return 0
    return summarize(args) if args.cmd == "summarize" else verify_dry_run(args)


if __name__ == "__main__":
    sys.exit(main())
