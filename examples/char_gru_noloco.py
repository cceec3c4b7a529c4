"""A character-level GRU (a model noloco does not ship) trained on Tiny
Shakespeare with NoLoCo, one replica a process, by your own PyTorch loop:

    noloco launch 4 -- python3 examples/char_gru_noloco.py     # build/noloco from a source build

or under torchrun:

    NOLOCO_RUN_TOKEN=$(head -c 16 /dev/urandom | xxd -p) torchrun --standalone \
        --nproc_per_node=4 examples/char_gru_noloco.py

Every replica samples its own windows of the text; every 50 steps each averages
with one random partner. A SIGTERM makes a replica leave the run at the end of
its step while the others go on. A replica started again by the launcher
(`noloco launch 4 --restarts 2 -- ...`), or a new one joining the run

    noloco launch 4 --join-dir /tmp/gru -- python3 examples/char_gru_noloco.py
    python3 examples/char_gru_noloco.py --join /tmp/gru     # meanwhile, elsewhere

takes a live replica's weights and AdamW state at its next outer step and
goes on from that replica's step.

Across homes (NAT routers, firewalls): on a public machine `noloco serve
advertise=ITS_ADDRESS` prints three export lines; in each home, those lines, then

    RANK=$i WORLD_SIZE=4 python3 examples/char_gru_noloco.py --bind $MY_LAN_ADDRESS --uplink 20mbit

--bind (this machine's own address, where its links listen and punch from)
lets two homes punch a hole through their routers; without it the links
listen on loopback and every byte goes through the serve's relay. --uplink is
the home's upload speed (a speed test's figure)."""
import argparse
import os

import torch

import noloco

parser = argparse.ArgumentParser()
parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"))
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--context", type=int, default=64)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--join", help="join the run of `noloco launch --join-dir DIR` as a new replica")
parser.add_argument("--bind", help="this machine's own address, for links to other homes (see above)")
parser.add_argument("--uplink", help="this home's upload speed, e.g. 20mbit")
args = parser.parse_args()

raw = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
vocab = raw.unique()
ids = torch.searchsorted(vocab, raw)  # byte -> its index in the vocabulary
split = int(0.9 * len(ids))
train_ids, val_ids = ids[:split], ids[split:]


class CharGRU(torch.nn.Module):
    def __init__(self, vocab_size, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab_size)

    def forward(self, x):
        out, _ = self.gru(self.embed(x))
        return self.head(out)


def batch(source, generator):
    starts = torch.randint(len(source) - args.context - 1, (args.batch,), generator=generator)
    x = torch.stack([source[s:s + args.context] for s in starts])
    y = torch.stack([source[s + 1:s + args.context + 1] for s in starts])
    return x, y


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, len(vocab)), y.reshape(-1))


torch.manual_seed(0)  # the same initial weights on every replica
model = CharGRU(len(vocab), args.hidden)
inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
# A restarted or joining replica waits here for a live one's state (AdamW's too).
network = {key: value for key, value in (("bind", args.bind), ("uplink", args.uplink)) if value}
outer = noloco.OuterOptimizer(model.named_parameters(), method="noloco", outer_interval=50, inner_optimizer=inner,
                              join=args.join, **network)
rank, first = outer.replica, outer.inner_steps
if outer.rejoined:
    print(f"replica {rank}: took replica {outer.rejoined['donor']}'s state at step {first}")
data = torch.Generator().manual_seed(1000 + rank + 7919 * first)  # each replica (and restart) its own windows

for step in range(first, args.steps):
    x, y = batch(train_ids, data)
    loss = loss_of(model, x, y)
    inner.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    inner.step()
    report = outer.step()
    if report is not None:
        if report["left"]:
            print(f"replica {rank}: left the run after step {step + 1}")
            break
        lost = f", lost {report['lost']}" if report["lost"] else ""
        print(f"replica {rank} step {step + 1}: loss {loss.item():.3f}, averaged with {report['arrived']}{lost}")
outer.finish()

with torch.no_grad():
    val = sum(loss_of(model, *batch(val_ids, torch.Generator().manual_seed(k))).item() for k in range(20)) / 20
print(f"replica {rank}: val loss {val:.3f}, {outer.outer_steps} outer steps, "
      f"{outer.outer_bytes / 1e6:.1f} MB sent, {outer.bits_per_param_per_inner_step:.3f} bits/param/inner step")
