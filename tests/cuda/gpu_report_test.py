"""Unit tests of the GPU check's step classification (tests/cuda/gpu_report.py)."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else __file__)))
import gpu_report as r  # noqa: E402

GTEST_PASS = "[==========] 3 tests ran.\n[  PASSED  ] 3 tests.\n"
GTEST_SKIP = ("[ RUN      ] A.b\nx.cc:12: Skipped\nno CUDA device: cudaGetDeviceCount failed\n"
              "[  SKIPPED ] A.b (0 ms)\n[  PASSED  ] 0 tests.\n[  SKIPPED ] 1 test, listed below:\n")
GTEST_FAIL = "[  FAILED  ] A.b (3 ms)\n[  FAILED  ] 1 test, listed below:\n[  FAILED  ] A.b\n"


class Classify(unittest.TestCase):
    def test_gtest(self):
        self.assertEqual(r.classify("gtest", "ran", 0, GTEST_PASS)[0], "passed")
        status, reason, _ = r.classify("gtest", "ran", 0, GTEST_SKIP)
        self.assertEqual((status, reason), ("skipped", "no CUDA device: cudaGetDeviceCount failed"))
        status, reason, _ = r.classify("gtest", "ran", 1, GTEST_FAIL)
        self.assertEqual((status, reason), ("failed", "failed: A.b"))
        self.assertEqual(r.classify("gtest", "ran", 0, "no summary")[0], "failed")

    def test_two_gpu_steps(self):
        # Every test skipped because the machine has one GPU: neither a pass nor a failure.
        two = ("x.cc:9: Skipped\nneeds 2 GPUs (NCCL refuses two ranks); this machine has 1\n[  SKIPPED ] T.a\n"
               "x.cc:9: Skipped\nneeds 2 GPUs (NCCL refuses two ranks); this machine has 1\n[  SKIPPED ] T.b\n"
               "[  PASSED  ] 0 tests.\n[  SKIPPED ] 2 tests, listed below:\n")
        self.assertEqual(r.classify("gtest_2gpu", "ran", 0, two)[0], "needs 2 GPUs")
        self.assertTrue(r.judge("gtest_2gpu", "needs 2 GPUs", "needs 2 GPUs", "gpu"))
        # The same binary without a GPU skips for that reason: a skip, as in any dry run.
        self.assertEqual(r.classify("gtest_2gpu", "ran", 0, GTEST_SKIP)[0], "skipped")
        self.assertTrue(r.judge("gtest_2gpu", "skipped", "no CUDA device", "dry"))
        self.assertFalse(r.judge("gtest_2gpu", "skipped", "no CUDA device", "gpu"))
        # A one-GPU reason on only some of the skips is no excuse for the others.
        mixed = two.replace("needs 2 GPUs (NCCL refuses two ranks); this machine has 1\n[  SKIPPED ] T.b",
                            "no torch\n[  SKIPPED ] T.b")
        self.assertEqual(r.classify("gtest_2gpu", "ran", 0, mixed)[0], "skipped")
        # On a plain gtest step that reason is a skip like any other.
        self.assertEqual(r.classify("gtest", "ran", 0, two)[0], "skipped")
        # Two GPUs: they ran, and pass or fail on their merits.
        self.assertEqual(r.classify("gtest_2gpu", "ran", 0, GTEST_PASS)[0], "passed")
        self.assertEqual(r.classify("gtest_2gpu", "ran", 1, GTEST_FAIL)[0], "failed")

    def test_verified_backends(self):
        def step(status, *backends):
            return {"status": status, "backends": list(backends)}
        gpu = {"mode": "gpu", "steps": [step("passed", "nccl"), step("needs 2 GPUs", "nccl"),
                                        step("passed", "cuda_ipc"), step("failed", "cuda_ipc"),
                                        step("skipped", "torch_ipc"), step("passed", "ucx")]}
        self.assertEqual(r.verified_backends([gpu]), {"nccl": "yes (1 GPU)", "cuda_ipc": "no", "torch_ipc": "no",
                                                      "ucx": "yes"})
        self.assertEqual(r.verified_backends([dict(gpu, mode="dry")]), {})

    def test_loader_failure_and_timeouts(self):
        text = "x: error while loading shared libraries: libssl.so.3: cannot open shared object file\n"
        self.assertEqual(r.classify("gtest", "ran", 127, text)[:2],
                         ("failed", "error while loading shared libraries: libssl.so.3: cannot open shared object file"))
        self.assertEqual(r.classify("json", "ran", 124, "")[0], "timeout")
        self.assertEqual(r.classify("json", "ran", 137, "")[0], "timeout")
        self.assertEqual(r.classify("json", "not_run", None, "")[0], "not run (budget)")

    def test_json(self):
        self.assertEqual(r.classify("json", "ran", 0, 'x\n{"a": 1}\n')[:2], ("passed", ""))
        self.assertEqual(r.classify("json", "ran", 0, '{"skipped": true, "reason": "no GPU"}')[:2],
                         ("skipped", "no GPU"))
        self.assertEqual(r.classify("json", "ran", 1, '{"passed": false}')[0], "failed")
        self.assertEqual(r.classify("json", "ran", 0, '{"passed": false}')[0], "failed")
        self.assertEqual(r.classify("json", "ran", 0, '{"error": "no GPU"}')[0], "failed")
        self.assertEqual(r.classify("json", "ran", 0, "no json")[0], "failed")

    def test_judge(self):
        # On a GPU machine only a pass is good; a skip there means the check ran nothing.
        self.assertTrue(r.judge("gtest", "passed", "", "gpu"))
        self.assertFalse(r.judge("gtest", "skipped", "no GPU", "gpu"))
        self.assertFalse(r.judge("json", "skipped", "no GPU", "gpu"))
        # In a dry run a GPU step must skip with a reason.
        self.assertTrue(r.judge("gtest", "skipped", "no GPU", "dry"))
        self.assertFalse(r.judge("gtest", "skipped", "skipped without a reason", "dry"))
        self.assertFalse(r.judge("gtest", "passed", "", "dry"))
        self.assertTrue(r.judge("gtest_cpu", "passed", "", "dry"))
        self.assertFalse(r.judge("json", "failed", "x", "dry"))
        self.assertFalse(r.judge("preflight", "failed", "ldd_missing", "dry"))

    def test_environment(self):
        env = r.environment("host: a\ngpu: 0, H200\ngpu: 1, H200\n---- details\nhost: ignored\n")
        self.assertEqual(env, {"host": "a", "gpu": ["0, H200", "1, H200"]})


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
