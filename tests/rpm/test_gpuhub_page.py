#!/usr/bin/env python3
"""Unit tests of the gpuhub page's wording (rpm/share/jupyterhub/gpuhub_page.py) for what the lab
cannot show: a GPU sampled now (the lab agent has no NVML), a quota nearly or fully used.
Needs the hub's Python (jupyterhub, tornado): tests/system/jupyterhub-profiles.sh runs it with
/opt/gpuhub-lab/jupyterhub/bin/python -B tests/rpm/test_gpuhub_page.py."""
import os
import sys
import unittest

sys.dont_write_bytecode = True  # no __pycache__ in rpm/share (the RPM ships that directory whole)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../rpm/share/jupyterhub"))
import gpuhub_page as page  # noqa: E402

GIB = 2**30


class GpuLine(unittest.TestCase):
    def test_sampled_now_with_mean_and_peak(self):
        g = {"index": 1, "shards": 7, "current": {"util": 61.6, "vram_bytes": 3 * GIB, "at": 1}, "mean_util": 40.25, "peak_vram_bytes": 5 * GIB}
        self.assertEqual(page.gpu_line(g), "GPU 1 (7 shards): now 62 % util, 3.0 GiB VRAM; mean 40.2 %, peak 5.0 GiB")

    def test_no_sample(self):
        for cur in (None, {}, {"util": None}):
            g = {"index": 0, "current": cur, "mean_util": None, "peak_vram_bytes": None}
            self.assertEqual(page.gpu_line(g), "GPU 0: now: no sample (no GPU telemetry for this job); mean -, peak -")


class Quota(unittest.TestCase):
    def test_states(self):
        self.assertEqual(page.quota_state({"percent": 12, "held": False}), "ok")
        self.assertEqual(page.quota_state({"percent": 85, "held": False}), "nearly used up")
        self.assertEqual(page.quota_state({"percent": 106, "held": True}), "used up: new GPU jobs wait (running ones go on)")

    def test_hours_and_reset(self):
        self.assertEqual(page.hours(172.04), "172.0")
        self.assertEqual(page.hours(None), "-")
        self.assertEqual(page.utc(1798761600), "2027-01-01 00:00 UTC")
        self.assertEqual(page.utc(None), "")


if __name__ == "__main__":
    unittest.main()
