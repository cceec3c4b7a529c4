#!/usr/bin/env python3
"""A stranger on the workers' loopback, for the drill in docs/rendezvous.md.

Connects to the TCP ports that listen on 127.0.0.1 while it runs (not those
that listened before it started) and holds every connection a port accepts,
silently, or after sending 100 kB of garbage (--garbage). Two ways to find
the ports:
  --sweep  what a stranger elsewhere on the network can do: connect to every
           port of the ephemeral range, in batches, over and over;
  --proc   what a process on the same machine can do: read /proc/net/tcp in
           a tight loop and connect to each new listening port at once.
Usage: port_stranger.py SECONDS (--sweep | --proc) [--garbage]
"""
import errno
import os
import select
import socket
import sys
import time


def listening():
    ports = set()
    with open('/proc/net/tcp') as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == '0A' and fields[1].startswith('0100007F:'):
                ports.add(int(fields[1].split(':')[1], 16))
    return ports


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ('--sweep', '--proc'):
        sys.exit(__doc__.strip().splitlines()[-1])
    end = time.time() + float(sys.argv[1])
    garbage = '--garbage' in sys.argv
    before = listening()
    held = []

    def hold(s):
        if garbage:
            s.setblocking(True)
            try:
                s.sendall(os.urandom(100 * 1024))
            except OSError:  # the port turned it away
                pass
        held.append(s)

    if sys.argv[2] == '--proc':
        seen = set()
        while time.time() < end:
            for port in listening() - before - seen:
                seen.add(port)
                s = socket.socket()
                s.settimeout(0.2)
                try:
                    s.connect(('127.0.0.1', port))
                    hold(s)
                except OSError:
                    s.close()
        print(f'stranger (--proc): {len(seen)} new listening ports seen, {len(held)} connections held', flush=True)
        return
    low, high = map(int, open('/proc/sys/net/ipv4/ip_local_port_range').read().split())
    sweeps, batch = 0, 2000
    while time.time() < end:
        for start in range(low, high + 1, batch):
            pending = {}
            for port in range(start, min(start + batch, high + 1)):
                if port in before:
                    continue
                s = socket.socket()
                s.setblocking(False)
                if s.connect_ex(('127.0.0.1', port)) in (0, errno.EINPROGRESS):
                    pending[s] = port
                else:
                    s.close()
            poller = select.poll()
            for s in pending:
                poller.register(s, select.POLLOUT)
            ready = {fd for fd, events in poller.poll(10) if events & select.POLLOUT}
            for s, port in pending.items():
                connected = s.fileno() in ready and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                if connected and s.getsockname()[1] != port:  # not a self-connection
                    hold(s)
                else:
                    s.close()
        sweeps += 1
    print(f'stranger (--sweep): {sweeps} sweeps of {high - low + 1} ports, {len(held)} connections held', flush=True)


if __name__ == '__main__':
    main()
