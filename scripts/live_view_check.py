#!/usr/bin/env python3
"""Measures the live page (issue 68) on a local 4-replica NoLoCo run, the page
open in headless Chromium (Debian's) and read through its DevTools protocol:

  latency  after a worker writes a train line to metrics.jsonl, how long until
           the page shows that step (or a later one) for its replica
  pace     the run's wall time (summary.json's seconds) with live_status=false
           and no page, against live_status=true with `noloco watch` and the
           page open and refreshing; alternated, --repeats times each.
           --viewer chromium renders the page on this machine, sharing the
           run's cores; --viewer fetch stands in for a browser elsewhere (an
           SSH tunnel): it asks for the page's data as the page does, every
           half second, and renders nothing

    /usr/bin/python3 scripts/live_view_check.py latency [--steps 600]
    /usr/bin/python3 scripts/live_view_check.py pace [--repeats 3] [--steps 400] [--viewer chromium|fetch]

Other run keys go after `--` (key=value), e.g. -- data=OTHER.txt hidden=64.
Needs build/noloco, chromium and python3-websocket (scripts/setup.sh).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOLOCO = os.path.join(SOURCE, "build", "noloco")


def start_run(out, steps, live, extra):
    keys = [f"out={out}", "replicas=4", "method=noloco", f"steps={steps}", "outer_interval=10", "eval_interval=50",
            "log_interval=10", "sample_tokens=0", f"live_status={'true' if live else 'false'}"] + extra
    return subprocess.Popen([NOLOCO, "train", "configs/shakespeare.yaml"] + keys, cwd=SOURCE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(path, seconds=120):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit(f"{path} did not appear in {seconds} s")
        time.sleep(0.05)


def start_watch(run_dir):
    """`noloco watch` of the run in `run_dir`, and the URL it printed."""
    wait_for(os.path.join(run_dir, "join.json"))
    watch = subprocess.Popen([NOLOCO, "watch", run_dir], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = watch.stdout.readline().strip()
    if not url.startswith("http"):
        sys.exit(f"watch printed no URL: {url!r}")
    return watch, url


class Fetcher:
    """A browser on another machine, as the run's machine sees it: the page's data every half second."""

    def __init__(self, run_dir, scratch):
        self.watch, url = start_watch(run_dir)
        data = url.replace("/?key=", "/state.json?key=")
        self.stop = False
        import threading

        def fetch():
            while not self.stop:
                urllib.request.urlopen(data, timeout=10).read()
                time.sleep(0.5)
        self.thread = threading.Thread(target=fetch)
        self.thread.start()

    def close(self):
        self.stop = True
        self.thread.join()
        self.watch.terminate()
        self.watch.wait(timeout=20)


class Page:
    """`noloco watch` of the run in `run_dir`, its page open in headless Chromium."""

    def __init__(self, run_dir, scratch):
        self.watch, url = start_watch(run_dir)
        port = 9300 + os.getpid() % 500
        self.chromium = subprocess.Popen(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
             f"--user-data-dir={scratch}/chromium", "--window-size=1300,1500", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=1))
                target = next(p for p in pages if p.get("type") == "page")
                break
            except Exception:
                time.sleep(0.1)
        else:
            sys.exit("chromium's DevTools did not answer")
        self.socket = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=10)
        self.calls = 0

    def steps(self):
        """{rank: step} as the page's table shows it now."""
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": "Runtime.evaluate", "params": {
            "expression": "JSON.stringify([...document.querySelectorAll('#members tbody tr')]"
                          ".map(r => [Number(r.dataset.rank), Number(r.dataset.step)]))",
            "returnByValue": True}}))
        while True:
            answer = json.loads(self.socket.recv())
            if answer.get("id") == self.calls:
                return dict(json.loads(answer["result"]["result"]["value"]))

    def close(self):
        self.socket.close()
        for p in (self.chromium, self.watch):
            p.terminate()
            p.wait(timeout=20)


def new_train_lines(path, offset):
    """(replica, step) of the complete train lines of metrics.jsonl after `offset`; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    found = []
    for line in data[:end].splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            found.append((record["replica"], record["step"]))
    return found, offset + end


def cpu_seconds(pid, tid=None):
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        fields = open(path).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return None


class CpuTally:
    """CPU seconds by part, sampled while they run (a process's counters go with it):
    the workers, their status threads, the watcher, the browser and the store."""

    def __init__(self):
        self.seen = {}  # (part, pid, tid) -> latest CPU seconds

    def sample(self):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            part = ("worker" if f"{NOLOCO} train" in command and "out=" in command else
                    "watcher" if f"{NOLOCO} watch" in command else
                    "browser" if "chromium" in command else
                    "store" if command.startswith("etcd") or "/etcd " in command else None)
            if not part:
                continue
            value = cpu_seconds(pid)
            if value is not None:
                self.seen[(part, pid, None)] = value
            if part == "worker":
                for tid in os.listdir(f"/proc/{pid}/task"):
                    try:
                        if open(f"/proc/{pid}/task/{tid}/comm").read().strip() == "noloco-status":
                            self.seen[("status threads", pid, tid)] = cpu_seconds(pid, tid) or 0
                    except OSError:
                        pass

    def totals(self):
        out = {}
        for (part, _, _), value in self.seen.items():
            out[part] = out.get(part, 0) + value
        return out


def latency(args, extra):
    scratch = tempfile.mkdtemp(prefix="noloco_live_")
    run_dir = os.path.join(scratch, "run")
    run = start_run(run_dir, args.steps, True, extra)
    cpu = CpuTally()
    page = Page(run_dir, scratch)
    written, shown = {}, {}  # (replica, step) -> first time seen in the file; replica -> [(time, step)]
    offset = 0
    while run.poll() is None:
        now = time.time()
        lines, offset = new_train_lines(os.path.join(run_dir, "metrics.jsonl"), offset)
        for key in lines:
            written.setdefault(key, now)
        for rank, step in page.steps().items():
            if not shown.get(rank) or shown[rank][-1][1] != step:
                shown.setdefault(rank, []).append((now, step))
        if int(now * 20) % 10 == 0:
            cpu.sample()
        time.sleep(0.05)
    page.close()
    totals = cpu.totals()
    print("CPU seconds: " + ", ".join(f"{part} {value:.1f}" for part, value in sorted(totals.items())) +
          f"; the status threads, watcher and browser are {100 * (totals.get('status threads', 0) + totals.get('watcher', 0) + totals.get('browser', 0)) / totals['worker']:.1f}% of the workers' "
          f"(the status threads alone {100 * totals.get('status threads', 0) / totals['worker']:.2f}%)")
    delays = []
    for (replica, step), at in written.items():
        seen = [t for t, s in shown.get(replica, []) if s >= step and t >= at - 0.05]
        if seen and shown[replica][0][0] < at:  # the page was open when the line was written
            delays.append(max(0.0, seen[0] - at))
    shutil.rmtree(scratch, ignore_errors=True)
    if not delays:
        sys.exit("no train line was both written and shown")
    delays.sort()
    print(f"{len(delays)} train lines of {len(written)}: page behind metrics.jsonl by median "
          f"{statistics.median(delays):.2f} s, p95 {delays[int(0.95 * (len(delays) - 1))]:.2f} s, "
          f"max {delays[-1]:.2f} s")


def pace(args, extra):
    seconds, rates = {False: [], True: []}, {False: [], True: []}
    for repeat in range(args.repeats):
        for live in (False, True):
            scratch = tempfile.mkdtemp(prefix="noloco_live_")
            run_dir = os.path.join(scratch, "run")
            run = start_run(run_dir, args.steps, live, extra)
            page = (Page if args.viewer == "chromium" else Fetcher)(run_dir, scratch) if live else None
            run.wait()
            if page:
                page.close()
            summary = json.load(open(os.path.join(run_dir, "summary.json")))
            seconds[live].append(summary["seconds"])
            rate = steady_tokens_per_second(os.path.join(run_dir, "metrics.jsonl"), args.steps)
            rates[live].append(rate)
            print(f"repeat {repeat}: {'status, page open' if live else 'no status, no page':18} "
                  f"{summary['seconds']:.1f} s, {rate:.0f} tokens/s in the second half", flush=True)
            shutil.rmtree(scratch, ignore_errors=True)
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"median wall: {off:.1f} s without, {on:.1f} s with the status and the page ({args.viewer}): "
          f"{100 * (on / off - 1):+.1f}%")
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"median tokens/s in the second half: {off:.0f} without, {on:.0f} with: {100 * (on / off - 1):+.1f}%")


def steady_tokens_per_second(metrics, steps):
    """The run's pace once everything has started (the watcher, the browser): the
    replicas' tokens over the seconds of their second half, summed."""
    first, last = {}, {}
    for line in open(metrics):
        r = json.loads(line)
        if r.get("split") != "train" or r["step"] < steps // 2:
            continue
        first.setdefault(r["replica"], r)
        last[r["replica"]] = r
    return sum((last[k]["tokens"] - first[k]["tokens"]) / (last[k]["elapsed"] - first[k]["elapsed"])
               for k in first if last[k]["elapsed"] > first[k]["elapsed"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["latency", "pace"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--viewer", choices=["chromium", "fetch"], default="chromium")
    parser.add_argument("extra", nargs="*", help="run keys (key=value), after --")
    args = parser.parse_args()
    (latency if args.what == "latency" else pace)(args, args.extra)


if __name__ == "__main__":
    main()
