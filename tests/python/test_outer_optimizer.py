"""The Python module (import noloco) under four processes on this machine.
ctest runs one case a test: test_outer_optimizer.py CASE BUILD_DIR.

  paper_update   torchrun, inner lr 0 and θ moved by the test: each outer step
                 equals the paper's update computed from all replicas (1e-5)
  trains         torchrun, NoLoCo and DiLoCo with a real lr: the loss falls and
                 the replicas' spread is reported
  paces          torchrun, pace=speed, one replica three times slower: it
                 trains about a third of the slots, the others nearly all, and
                 each outer step reports the steps behind its increment
  message_bytes  the bytes of each outer step equal the CLI's for the same keys
                 and parameter count
  cli_llama      the CLI's Llama trained by the CLI and by a Python loop
                 (noloco.Llama, torch.optim.AdamW): the same losses at every
                 step, before and after each outer step, to float tolerance
  refuses        an unknown key, another method, a bad value, no parameters, no
                 RANK: each a ValueError naming it; a replica whose module
                 differs from the run's, naming both
  resumes        saved at step 15 by state_dict() and started again from it: the
                 same weights at the end, bit for bit
  joins          a replica started by hand joins a `noloco launch --join-dir` run,
                 and a torchrun run, and takes a live replica's state (AdamW's
                 too), bit for bit
  restarts       under `noloco launch --restarts 1` a killed replica is started
                 again and takes a live replica's state likewise
  survives       under `noloco launch` (torchrun's agent stops every worker
                 when one fails): one replica killed, one leaving by SIGTERM,
                 the rest train to the end; the launcher exits 3
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

from markers import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "outer_optimizer_worker.py")
TIMEOUT = 300


def environment(build):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(build, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["NOLOCO_RUN_TOKEN"] = "python-module-test-token"
    env["OMP_NUM_THREADS"] = "1"
    return env


def results(output):
    found = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["rank"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(build, args, replicas=4):
    """`replicas` (four) under torchrun; their RESULT lines by rank."""
    # Not --standalone: its rendezvous port is fixed (29400), and ctest runs two of these at once.
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={replicas}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--redirects=2", "--tee=2", WORKER] + args
    done = subprocess.run(command, env=environment(build), capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0:
        sys.exit(f"torchrun {' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    found = results(done.stdout)
    assert len(found) == replicas, f"{len(found)} of {replicas} replicas reported:\n{done.stdout[-3000:]}"
    return found


def check(condition, message):
    if not condition:
        sys.exit("FAILED: " + message)


def paper_update(build):
    for keys in (["outer_interval=5"], ["outer_interval=5", "gamma=0.3", "outer_momentum=0.8"]):
        found = torchrun(build, ["paper_update", "--steps", "20"] + keys)
        for r in found:
            print(f"{' '.join(keys)}: replica {r['rank']}: {r['outer_steps']} outer steps, groups {r['groups']}, "
                  f"largest difference from the paper's update {r['worst']:.2e}")
            check(r["outer_steps"] == 4, f"replica {r['rank']} took {r['outer_steps']} outer steps, not 4")
            check(all(len(g) == 2 and r["rank"] in g for g in r["groups"]), f"groups of two: {r['groups']}")
            check(r["worst"] < 1e-5, f"replica {r['rank']} is {r['worst']:.2e} from the paper's update")


def trains(build):
    for method, keys in (("noloco", ["outer_interval=10"]), ("diloco", ["outer_interval=10"])):
        found = torchrun(build, ["trains", "--steps", "200", "--method", method] + keys)
        for r in found:
            print(f"{method}: replica {r['rank']}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}, "
                  f"replicas' weight spread {r['spread']:.3e}, {r['outer_steps']} outer steps, "
                  f"{r['bits_per_param_per_inner_step']:.3f} bits/param/inner step")
            check(r["outer_steps"] == 20, f"{r['outer_steps']} outer steps, not 20")
            check(r["last_loss"] < 0.5 * r["first_loss"], "the loss did not halve")
        spread = found[0]["spread"]
        check(0 < spread < 0.05 if method == "noloco" else spread < 1e-6, f"{method}: spread {spread}")


def paces(build):
    for method in ("noloco", "diloco"):
        found = torchrun(build, ["paces", "--steps", "120", "--method", method, "outer_interval=10"])
        for r in found:
            share = r["trained"] / r["slots"]
            print(f"{method}: replica {r['rank']}: trained {r['trained']} of {r['slots']} slots ({share:.2f}), "
                  f"{r['outer_steps']} outer steps, steps behind each increment {r['reported_steps']}")
            check(r["outer_steps"] == 12, f"{r['outer_steps']} outer steps, not 12")
            check("trains_now()" in r["refused"], f"step() before trains_now() was not refused: {r['refused']!r}")
            check(sum(r["reported_steps"]) <= r["trained"] and r["reported_steps"][-1] >= 1,
                  f"the reports' steps {r['reported_steps']} against {r['trained']} trained")
            if r["rank"] == 3:
                check(0.2 <= share <= 0.55, f"the slow replica trained {share:.2f} of the slots, not about a third")
            else:
                check(share >= 0.8, f"a fast replica trained {share:.2f} of the slots")


def small_run_keys(out):
    """A small, fast run of the demo config on a text written into `out`."""
    text = os.path.join(out, "corpus.txt")
    with open(text, "w") as f:
        f.write("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(2000)))
    return {"data": text, "hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "context": 32, "warmup": 2,
            "eval_interval": 1000, "eval_batches": 2, "sample_tokens": 0, "log_interval": 1, "steps": 20}


def cli_run(build, keys, out, replicas=4):
    """`noloco train` of the small run with `replicas` and `keys`; its metrics records."""
    command = [os.path.join(build, "noloco"), "train", "configs/shakespeare.yaml", f"out={out}/run",
               f"replicas={replicas}"]
    command += [f"{k}={v}" for k, v in small_run_keys(out).items()] + keys
    done = subprocess.run(command, cwd=SOURCE, capture_output=True, text=True, timeout=TIMEOUT)
    check(done.returncode == 0, f"the CLI run failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]


def cli_outer_bytes(build, keys, out, replicas):
    records = cli_run(build, keys, out, replicas)
    sent = [r["bytes"] for r in records if r.get("split") == "outer" and r["replica"] == 0]
    params = json.load(open(os.path.join(out, "run", "summary_r0.json")))["params"]
    return params, sent


def message_bytes(build):
    # Two replicas: a NoLoCo pair, a DiLoCo all-gather; what one sends does not grow with more.
    for keys in (["method=noloco", "outer_interval=5"], ["method=noloco", "compression=sparse", "overlap=true"],
                 ["method=diloco", "outer_interval=5", "wire_dtype=int8"]):
        with tempfile.TemporaryDirectory() as out:
            params, cli = cli_outer_bytes(build, keys, out, replicas=2)
        method = keys[0].split("=")[1]
        found = torchrun(build, ["message_bytes", "--steps", "20", "--params", str(params), "--method", method] + keys[1:],
                         replicas=2)
        print(f"{' '.join(keys)}: {params} parameters: CLI {cli}, Python {found[0]['bytes']}")
        check(len(cli) > 0, "the CLI took no outer step")
        for r in found:
            check(r["bytes"] == cli, f"replica {r['rank']} sent {r['bytes']}, the CLI's replica 0 {cli}")
            check(r["outer_bytes"] == sum(cli), f"replica {r['rank']}: outer_bytes {r['outer_bytes']}")


def cli_llama(build):
    outer = ["outer_interval=5"]
    with tempfile.TemporaryDirectory() as out:
        records = cli_run(build, ["method=noloco"] + outer, out)
        run = small_run_keys(out)
        run.update(out=os.path.join(out, "python"), replicas=4)
        found = torchrun(build, ["cli_llama", "--steps", "20", "--source", SOURCE, "--llama", json.dumps(run)] + outer)
    worst_train = worst_val = 0.0
    for r in found:
        cli = {rec["step"]: rec["loss"] for rec in records if rec["split"] == "train" and rec["replica"] == r["rank"]}
        cli_val = [rec["loss"] for rec in records if rec["split"] == "val" and rec["replica"] == r["rank"]][-1]
        check(sorted(cli) == list(range(1, 21)), f"CLI train records of replica {r['rank']}: steps {sorted(cli)}")
        differences = [abs(loss - cli[step + 1]) / abs(cli[step + 1]) for step, loss in enumerate(r["losses"])]
        worst_train = max(worst_train, max(differences))
        worst_val = max(worst_val, abs(r["val_loss"] - cli_val) / cli_val)
        print(f"replica {r['rank']}: train loss at steps 1, 6, 11, 16, 20: CLI "
              f"{[round(cli[s], 6) for s in (1, 6, 11, 16, 20)]}, Python "
              f"{[round(r['losses'][s - 1], 6) for s in (1, 6, 11, 16, 20)]}; final val loss CLI {cli_val:.6f}, "
              f"Python {r['val_loss']:.6f}")
    print(f"largest relative difference: train loss {worst_train:.2e} (80 steps), final val loss {worst_val:.2e}")
    check(worst_train < 1e-4 and worst_val < 1e-4, "the Python path is more than 1e-4 from the CLI's")


def refuses(build):
    """Bad settings are refused in one line, before anything joins a run."""
    program = """
import os, torch, noloco
def refused(make):
    try:
        make()
    except ValueError as e:
        return str(e)
    return "accepted"
params = lambda: torch.nn.Linear(2, 2).parameters()
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", steps=5)))
print(refused(lambda: noloco.OuterOptimizer(params(), method="ddp")))
print(refused(lambda: noloco.OuterOptimizer(params(), method="sgd")))
os.environ.update(RANK="0", WORLD_SIZE="2", NOLOCO_RUN_TOKEN="t")
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", outer_interval=0.5)))
print(refused(lambda: noloco.OuterOptimizer([], method="noloco")))
os.environ.pop("RANK")
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco")))
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", join=True)))
print(refused(lambda: noloco.OuterOptimizer(params(), method="diloco", join=True)))
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", join="/nonexistent")))
os.environ["NOLOCO_STORE"] = "tcp://127.0.0.1"
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", join=True)))
print(refused(lambda: noloco.OuterOptimizer(params(), method="noloco", inner_optimizer=object())))
"""
    done = subprocess.run([sys.executable, "-c", program], env=environment(build), capture_output=True, text=True,
                          timeout=TIMEOUT)
    check(done.returncode == 0, f"the program failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.splitlines()
    print("\n".join(lines))
    expected = ["steps is not a key of the outer optimizer", "method=ddp",
                "method=sgd: the outer optimizer is noloco or diloco", "outer_interval", "no parameters",
                "RANK is not set", "NOLOCO_STORE is not set", "a diloco run takes no joiners",
                "/nonexistent/join.json does not exist", "is not tcp://host:port", "not a torch.optim optimizer"]
    check(len(lines) == len(expected), f"{len(lines)} lines, expected {len(expected)}")
    for line, words in zip(lines, expected):
        check(words in line, f"'{line}' does not name {words}")
    check("none" not in lines[2] and "ddp" not in lines[2], f"'{lines[2]}' offers what Python does not run")
    refuses_another_model(build)


def refuses_another_model(build):
    """Two replicas whose modules differ: the second is refused before any
    step, naming both layouts (before, the smaller aborted inside Gloo)."""
    program = """
import os, torch, noloco
rank = int(os.environ["RANK"])
model = torch.nn.Linear(2, 2 + rank)
try:
    noloco.OuterOptimizer(model.named_parameters(), method="noloco", peer_timeout=20)
    print(f"REPLICA {rank} accepted", flush=True)
except ValueError as e:
    print(f"REPLICA {rank} refused: {e}", flush=True)
os._exit(0)
"""
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(program)
        script.flush()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--redirects=2", "--tee=2", script.name]
        done = subprocess.run(command, env=environment(build), capture_output=True, text=True, timeout=TIMEOUT)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("REPLICA"))
    print("\n".join(lines))
    check(done.returncode == 0 and len(lines) == 2, f"torchrun exited {done.returncode}:\n{done.stderr[-3000:]}")
    check(lines[0] == "REPLICA 0 accepted", lines[0])
    check("another config than the run's" in lines[1] and "user_model: 9 parameters in 2 tensors" in lines[1]
          and "6 parameters in 2 tensors" in lines[1], f"'{lines[1]}' does not name both models")


def resumes(build):
    """state_dict() and load_state_dict(): a run saved at step 15 and started
    again from the save (a new torchrun, a new store) ends on the same weights,
    bit for bit, as the run that went on; with overlap, an exchange is in flight at the save."""
    for keys in (["outer_interval=10"], ["outer_interval=10", "overlap=true", "compression=sparse"]):
        with tempfile.TemporaryDirectory() as out:
            common = ["resumes", "--steps", "40", "--save-at", "15", "--dir", out] + keys
            whole = torchrun(build, common, replicas=2)
            resumed = torchrun(build, common + ["--resume"], replicas=2)
        for a, b in zip(whole, resumed):
            check(b["first_step"] == 15, f"replica {b['rank']} resumed at {b['first_step']}")
            check(a["weights"] == b["weights"], f"{' '.join(keys)}: replica {a['rank']} ends elsewhere when resumed")
        print(f"{' '.join(keys)}: 2 replicas resumed at step 15 end bit-identical at step 40")


def survives(build):
    """Under `noloco launch` (torchrun's agent stops every worker when one fails):
    replica 3 killed by its drill, replica 2 leaving by SIGTERM; the others
    train to the end, and the launcher exits 3 as after a CLI run that lost workers."""
    command = [os.path.join(build, "noloco"), "launch", "4", "--", sys.executable, WORKER, "survives", "--steps", "120",
               "--leaver", "2", "--leave-at", "60", "outer_interval=10", "inject_crash=3:35", "peer_timeout=20"]
    done = subprocess.run(command, env=environment(build), capture_output=True, text=True, timeout=TIMEOUT)
    print(done.stderr[-1500:])
    check(done.returncode == 3, f"noloco launch exited {done.returncode}, not 3 (finished without some workers)")
    check("worker 3 was killed by signal 9" in done.stderr, "the launcher did not name worker 3 killed")
    found = {r["rank"]: r for r in results(done.stdout)}
    check(sorted(found) == [0, 1, 2], f"replicas that reported: {sorted(found)}")
    for rank in (0, 1, 2):
        print(f"replica {rank}: {found[rank]}")
    check(found[2]["left_at"] == 61 and found[2]["steps"] == 61, f"replica 2 left at {found[2]['left_at']}")
    for rank in (0, 1):
        check(found[rank]["steps"] == 120, f"replica {rank} stopped at step {found[rank]['steps']}")
        check(found[rank]["left_at"] is None, f"replica {rank} left")
    check(any(3 in found[rank]["lost"] for rank in (0, 1, 2)), "nobody reported replica 3 lost")


def check_handover(found, served, newcomer, joined):
    """The arriving replica took, bit for bit, the state its donor handed over
    (weights, AdamW's moments and step), at the donor's outer step, and trained
    to the end with the others."""
    took = found[newcomer]["took"]
    print(f"donor: {served}\narriving replica {newcomer}: {took['rejoined']}; trained to step "
          f"{found[newcomer]['steps']}, loss {found[newcomer]['first_loss']:.4f} -> {found[newcomer]['last_loss']:.4f}")
    check(took["rejoined"] is not None and took["rejoined"]["joined"] == joined,
          f"replica {newcomer}: rejoined {took['rejoined']}")
    check(served["to"] == [newcomer] and served["step"] == took["rejoined"]["step"],
          f"served {served}, took {took['rejoined']}")
    check(took["rejoined"]["donor"] == served["by"], "the donor named is not the one that served")
    check(took["hash"] == served["hash"], "the state taken differs from the state handed over")
    check(took["rejoined"]["step"] % 10 == 0 and took["rejoined"]["step"] >= 50,
          "not taken at an outer step after the arriving replica started (step 50 on)")
    for rank, r in found.items():
        check(r["steps"] >= 200, f"replica {rank} stopped at step {r['steps']}")
    check(any(newcomer in g for rank, r in found.items() if rank != newcomer for g in r["groups"]),
          f"no live replica was grouped with replica {newcomer} after it arrived")
    check(found[newcomer]["last_loss"] < found[newcomer]["first_loss"], "the arriving replica's loss did not fall")


def joins(build):
    """A third replica started by hand, mid-run (once the others are at step
    50), joins a run of two and takes a live replica's state (with the AdamW
    state given as inner_optimizer); both ways a run is started:
    `noloco launch 2 --join-dir DIR` (join=DIR: the launcher's invitation and
    token; the launcher waits for the joiner and exits 0), and torchrun
    (join=True: NOLOCO_STORE=tcp://MASTER_ADDR:MASTER_PORT, its agent's store)."""
    for starter in ("launch", "torchrun"):
        with tempfile.TemporaryDirectory() as out:
            common = [WORKER, "handover", "--steps", "200", "--wait-at", "50", "--dir", out, "outer_interval=10",
                      "peer_timeout=30"]
            env, joiner_env = environment(build), environment(build)
            if starter == "launch":
                # No token given: the launcher makes one up and leaves it in DIR/run_token for the joiner.
                env.pop("NOLOCO_RUN_TOKEN")
                joiner_env.pop("NOLOCO_RUN_TOKEN")
                command = [os.path.join(build, "noloco"), "launch", "2", "--join-dir", out, "--", sys.executable]
                join = ["--join", out]
            else:
                port = free_port()
                command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={port}", "--redirects=2", "--tee=2"]
                joiner_env.update(NOLOCO_STORE=f"tcp://127.0.0.1:{port}", WORLD_SIZE="2")
                join = ["--join", "env"]
            run = subprocess.Popen(command + common, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
            try:
                check(wait_for(os.path.join(out, "waiting0"), 120), f"{starter}: replica 0 did not reach step 50")
                joiner = subprocess.run([sys.executable] + common + join, env=joiner_env, capture_output=True,
                                        text=True, timeout=TIMEOUT)
                stdout, stderr = run.communicate(timeout=TIMEOUT)
            finally:
                run.kill()
            print(f"{starter}:\n{stderr[-800:]}")
            check(joiner.returncode == 0, f"{starter}: the joiner exited {joiner.returncode}:\n{joiner.stderr[-3000:]}")
            check(run.returncode == 0, f"{starter} exited {run.returncode}:\n{stderr[-3000:]}")
            if starter == "launch":
                check("and 1 of 1 joiners" in stderr, "the launcher did not wait for the joiner")
            found = {r["rank"]: r for r in results(stdout + joiner.stdout)}
            check(sorted(found) == [0, 1, 2], f"{starter}: replicas that reported: {sorted(found)}")
            check_handover(found, json.load(open(os.path.join(out, "served.json"))), 2, joined=True)


def restarts(build):
    """`noloco launch 3 --restarts 1`: replica 2 killed at step 35 by its drill
    is started again, takes a live replica's state and trains to the end; the
    launcher exits 0."""
    with tempfile.TemporaryDirectory() as out:
        command = [os.path.join(build, "noloco"), "launch", "3", "--restarts", "1", "--", sys.executable, WORKER,
                   "handover", "--steps", "200", "--wait-at", "50", "--dir", out, "outer_interval=10",
                   "inject_crash=2:35", "peer_timeout=30"]
        done = subprocess.run(command, env=environment(build), capture_output=True, text=True, timeout=TIMEOUT)
        print(done.stderr[-1500:])
        check(done.returncode == 0, f"noloco launch exited {done.returncode}, not 0")
        check("worker 2 was killed by signal 9" in done.stderr and "started again" in done.stderr,
              "the launcher did not restart worker 2")
        found = {r["rank"]: r for r in results(done.stdout)}
        check(sorted(found) == [0, 1, 2], f"replicas that reported: {sorted(found)}")
        check_handover(found, json.load(open(os.path.join(out, "served.json"))), 2, joined=False)


if __name__ == "__main__":
    case, build = sys.argv[1], os.path.abspath(sys.argv[2])
    globals()[case](build)
    print(f"{case}: passed")
