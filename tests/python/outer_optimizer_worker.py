"""One replica of the Python module's tests (test_outer_optimizer.py starts
four, under torchrun or as its own launcher). Prints one line
`RESULT {json}` with what the test checks; asserts what it can alone."""
import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import noloco
from markers import wait_for


def emit(result):
    """The RESULT line, in one write: four processes share the pipe."""
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


def outer_steps(report):
    """The outer steps a report of step() or finish() tells of (finish() may apply several)."""
    if report is None or "outer_step" not in report:
        return []
    return report.get("outer_steps", [report])


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def keys(pairs):
    """key=value arguments as OuterOptimizer keyword arguments (values as text: the module reads them as the CLI does)."""
    return dict(p.split("=", 1) for p in pairs)


def paper_update(args):
    """Inner lr 0, with the test moving θ itself between outer steps: every
    outer step must equal the paper's update computed here from all replicas'
    parameters and the group the step reports."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    model = mlp(seed=rank)  # replicas start apart: the pull toward the group is visible
    k = keys(args.keys)
    opt = noloco.OuterOptimizer(model.named_parameters(), method="noloco", **k)
    inner = torch.optim.AdamW(model.parameters(), lr=0.0)
    alpha, beta = float(k.get("outer_momentum", 0.5)), float(k.get("outer_lr", 0.7))
    gamma = float(k.get("gamma", beta))
    interval = int(k["outer_interval"])
    phi = gathered(flat(model))
    momentum = torch.zeros_like(phi[rank])
    x = torch.randn(8, 16)
    worst, checked, groups = 0.0, 0, []
    for step in range(args.steps):
        inner.zero_grad()
        model(x).pow(2).mean().backward()
        inner.step()
        if step % interval == interval // 2:  # progress of the replica's own, as an inner step would make
            with torch.no_grad():
                torch.manual_seed(1000 * rank + step)
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        theta = flat(model)
        report = opt.step()
        if report is None:
            continue
        group = sorted(report["arrived"])
        delta = gathered(theta) - phi
        momentum = alpha * momentum + beta * delta[group].mean(0) + gamma * (phi[group].mean(0) - phi[rank])
        expected = phi[rank] + momentum
        worst = max(worst, (flat(model) - expected).abs().max().item())
        checked += 1
        groups.append(group)
        phi = gathered(flat(model))
    opt.finish()
    emit({"rank": rank, "outer_steps": checked, "worst": worst, "groups": groups})
    dist.destroy_process_group()  # before the interpreter's teardown, which may not join Gloo's threads


def fit_teacher(args, rank):
    """A real lr: this replica fits a fixed teacher on its own data. The
    model, the outer optimizer, the losses and the outer steps' reports."""
    teacher = mlp(seed=99)
    model = mlp(seed=0)
    opt = noloco.OuterOptimizer(model.named_parameters(), method=args.method, **keys(args.keys))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(rank)
    losses, reports = [], []
    for _ in range(args.steps):
        x = torch.randn(32, 16)
        with torch.no_grad():
            y = teacher(x)
        loss = (model(x) - y).pow(2).mean()
        inner.zero_grad()
        loss.backward()
        inner.step()
        reports += outer_steps(opt.step())
        losses.append(loss.item())
        opt.report(loss=loss.item(), val_loss=loss.item() if len(losses) % 50 == 0 else None)  # the live page's
    reports += outer_steps(opt.finish())
    return model, opt, losses, reports


def trains(args):
    """The teacher fitted under torchrun: the loss falls and the replicas' spread is reported."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    model, opt, losses, _ = fit_teacher(args, rank)
    everyone = gathered(flat(model))
    spread = everyone.std(0).mean().item()
    emit({"rank": rank, "first_loss": sum(losses[:10]) / 10, "last_loss": sum(losses[-10:]) / 10, "spread": spread,
          "outer_steps": opt.outer_steps, "bits_per_param_per_inner_step": opt.bits_per_param_per_inner_step})
    dist.destroy_process_group()


def paces(args):
    """pace=speed under torchrun: replica 3's steps take three times as long
    (a sleep standing in for a slower GPU). Each replica asks trains_now()
    before each slot and trains only where told; step() for every slot."""
    rank = int(os.environ["RANK"])
    model = mlp(seed=0)
    opt = noloco.OuterOptimizer(model.named_parameters(), method=args.method, pace="speed", **keys(args.keys))
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Long enough that a loaded machine's scheduling noise stays within the
    # 10% band that counts equal replicas as equal.
    step_seconds = 0.18 if rank == 3 else 0.06
    trained, reported_steps = 0, []
    try:
        opt.step()
        refused = ""
    except RuntimeError as e:  # a slot not asked about first
        refused = str(e)
    for _ in range(args.steps):
        if opt.trains_now():
            loss = model(torch.randn(8, 16)).pow(2).mean()
            inner.zero_grad()
            loss.backward()
            inner.step()
            time.sleep(step_seconds)
            trained += 1
        reported_steps += [r["trained_steps"] for r in outer_steps(opt.step())]
    reported_steps += [r["trained_steps"] for r in outer_steps(opt.finish())]
    emit({"rank": rank, "trained": trained, "slots": args.steps, "outer_steps": opt.outer_steps,
          "reported_steps": reported_steps, "refused": refused})


def homes(args):
    """The teacher fitted behind NAT on the WAN testbed, where only the outer
    optimizer's own traffic gets through (no torch.distributed): reports its
    exchanges and the bytes a relay carried."""
    rank = int(os.environ["RANK"])
    _, opt, _, reports = fit_teacher(args, rank)
    emit({"rank": rank, "outer_steps": len(reports),
          "exchanged": sum(1 for r in reports if len(r["group"]) > 1 and sorted(r["arrived"]) == sorted(r["group"])),
          "bytes_sent": opt.bytes_sent, "bytes_relayed": opt.bytes_relayed, "bytes_punched": opt.bytes_punched})


def message_bytes(args):
    """Parameters of the CLI's model's size: the bytes of each outer step."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)
    weights = torch.nn.Parameter(torch.randn(args.params) * 0.02)
    opt = noloco.OuterOptimizer([("weights", weights)], method=args.method, **keys(args.keys))
    inner = torch.optim.AdamW([weights], lr=1e-3)
    sent = []
    for _ in range(args.steps):
        inner.zero_grad()
        weights.pow(2).sum().backward()
        inner.step()
        sent += [s["bytes"] for s in outer_steps(opt.step())]
    sent += [s["bytes"] for s in outer_steps(opt.finish())]  # with overlap, the exchange still in flight
    emit({"rank": rank, "bytes": sent, "outer_bytes": opt.outer_bytes})


def survives(args):
    """inject_crash kills one replica; with --leave-at, another leaves by SIGTERM.
    The rest train to the end and say whom they lost."""
    rank = int(os.environ["RANK"])
    model = mlp(seed=0)
    opt = noloco.OuterOptimizer(model.named_parameters(), method="noloco", **keys(args.keys))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(rank)
    lost, left_at = set(), None
    for step in range(args.steps):
        x = torch.randn(32, 16)
        loss = model(x).pow(2).mean()
        inner.zero_grad()
        loss.backward()
        inner.step()
        if rank == args.leaver and step == args.leave_at:
            os.kill(os.getpid(), signal.SIGTERM)
        report = opt.step()
        if report is not None:
            lost.update(report.get("lost", []))  # a report of leaving alone has no outer step
            if report["left"]:
                left_at = step + 1
                break
    opt.finish()
    emit({"rank": rank, "lost": sorted(lost), "left_at": left_at, "steps": opt.inner_steps})


def resumes(args):
    """Saves everything at --save-at (the model's, AdamW's and the outer
    optimizer's state dicts) or starts from that save; prints the final weights' hash."""
    rank = int(os.environ["RANK"])
    model = mlp(seed=0)
    saved = os.path.join(args.dir, f"replica{rank}.pt")
    first = 0
    if args.resume:
        state = torch.load(saved)
        model.load_state_dict(state["model"])
    opt = noloco.OuterOptimizer(model.named_parameters(), method="noloco", **keys(args.keys))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.resume:
        opt.load_state_dict(state["outer"])
        inner.load_state_dict(state["inner"])
        first = opt.inner_steps
    for step in range(first, args.steps):
        torch.manual_seed(1000 * rank + step)
        loss = model(torch.randn(32, 16)).pow(2).mean()
        inner.zero_grad()
        loss.backward()
        inner.step()
        opt.step()
        if step + 1 == args.save_at and not args.resume:
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "outer": opt.state_dict()}, saved)
    opt.finish()
    emit({"rank": rank, "first_step": first, "weights": hashlib.sha256(flat(model).numpy().tobytes()).hexdigest()})


def state_hash(model, inner):
    """The weights and AdamW's state (moments, step) of every parameter, hashed."""
    h = hashlib.sha256(flat(model).numpy().tobytes())
    for p in model.parameters():
        state = inner.state.get(p, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                h.update(state[name].numpy().tobytes())
        if "step" in state:
            h.update(str(float(state["step"])).encode())
    return h.hexdigest()


def handover(args):
    """A replica that arrives in the running run (a joiner with --join, or one
    the launcher restarted) takes a live replica's weights, outer state and
    AdamW state at that replica's next outer step; the donor writes what it
    handed over, the arriving one what it took. The live replicas wait at
    --wait-at (saying so in DIR/waiting<rank>) for the arriving one to start, and do not finish before it has
    been served (a bounded wait)."""
    arriving = args.join is not None or int(os.environ.get("NOLOCO_RESTARTED", "0")) > 0
    model = mlp(seed=0)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    served = os.path.join(args.dir, "served.json")
    if arriving:
        open(os.path.join(args.dir, "arriving"), "w").close()
    opt = noloco.OuterOptimizer(model.named_parameters(), method="noloco", inner_optimizer=inner,
                                join=True if args.join == "env" else args.join, **keys(args.keys))
    rank = opt.replica
    took = {"rejoined": opt.rejoined, "hash": state_hash(model, inner)} if arriving else None
    torch.manual_seed(1000 + rank)
    step, groups, losses = opt.inner_steps, [], []
    deadline = time.monotonic() + 240
    while step < args.steps or (not arriving and not os.path.exists(served) and time.monotonic() < deadline):
        if not arriving and step == args.wait_at:
            open(os.path.join(args.dir, f"waiting{rank}"), "w").close()
            if not wait_for(os.path.join(args.dir, "arriving"), 120):
                break
            deadline = time.monotonic() + 120
        x = torch.randn(32, 16)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        inner.zero_grad()
        loss.backward()
        inner.step()
        losses.append(loss.item())
        report = opt.step()
        step += 1
        if report is not None:
            groups.append(sorted(report["group"]))
            if report["handed_over_to"]:
                with open(served + ".tmp", "w") as f:
                    json.dump({"by": rank, "to": report["handed_over_to"], "step": step,
                               "hash": state_hash(model, inner)}, f)
                os.rename(served + ".tmp", served)
        if not arriving and step > args.wait_at and not os.path.exists(served):
            time.sleep(0.01)  # paced while the arriving replica starts, so that the run is not over before
    opt.finish()
    emit({"rank": rank, "steps": opt.inner_steps, "took": took, "groups": groups,
          "first_loss": sum(losses[:10]) / max(1, len(losses[:10])), "last_loss": sum(losses[-10:]) / 10})


def cli_llama(args):
    """The CLI's Llama and batches (noloco.Llama), stepped by torch.optim.AdamW
    as the CLI's inner optimizer steps (weight decay on matrices only, its
    schedule, global-norm clipping), with the outer optimizer around it."""
    rank = int(os.environ["RANK"])
    llama = noloco.Llama(os.path.join(args.source, "configs", "shakespeare.yaml"), replica=rank,
                         **json.loads(args.llama))
    opt = noloco.OuterOptimizer(llama.named_parameters(), method="noloco", **keys(args.keys))
    named = llama.named_parameters()
    inner = torch.optim.AdamW([{"params": [t for _, t in named if t.dim() >= 2], "weight_decay": 0.1},
                               {"params": [t for _, t in named if t.dim() < 2], "weight_decay": 0.0}],
                              betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for step in range(args.steps):
        for group in inner.param_groups:
            group["lr"] = llama.learning_rate(step)
        inner.zero_grad()
        losses.append(llama.train_step(step))
        torch.nn.utils.clip_grad_norm_(llama.parameters(), 1.0)
        inner.step()
        opt.step()
    opt.finish()
    emit({"rank": rank, "losses": losses, "val_loss": llama.evaluate(args.steps), "bytes": opt.outer_bytes})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["paper_update", "trains", "paces", "homes", "message_bytes", "survives", "cli_llama",
                                           "resumes", "handover"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--method", default="noloco")
    parser.add_argument("--params", type=int, default=0)
    parser.add_argument("--leaver", type=int, default=-1)
    parser.add_argument("--leave-at", type=int, default=-1)
    parser.add_argument("--save-at", type=int, default=0, help="resumes: the step whose state is saved")
    parser.add_argument("--resume", action="store_true", help="resumes: start from the save")
    parser.add_argument("--dir", default=".", help="resumes: where the saves go; handover: the markers")
    parser.add_argument("--join", default=None, help="handover: join the run whose noloco launch --join-dir this is; env: the one NOLOCO_STORE names")
    parser.add_argument("--wait-at", type=int, default=50, help="handover: where live replicas wait for the arriving one")
    parser.add_argument("--llama", default="{}", help="cli_llama: the run's config keys, a JSON object")
    parser.add_argument("--source", default=".", help="cli_llama: the repository (its configs/)")
    parser.add_argument("keys", nargs="*", help="key=value settings of the outer optimizer")
    args = parser.parse_intermixed_args()
    globals()[args.mode](args)


if __name__ == "__main__":
    main()
