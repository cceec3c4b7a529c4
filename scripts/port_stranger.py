#!/usr/bin/env python3
"""A stranger at the workers' ports, for the drills in docs/rendezvous.md and
scripts/stranger_run.sh.

Connects to the TCP ports that listen on 127.0.0.1 while it runs (not those
that listened before it started) and holds every connection a port accepts,
silently, or after sending 100 kB of garbage (--garbage). Three ways to find
the ports:
  --sweep  what a stranger elsewhere on the network can do: connect to every
           port of the ephemeral range, in batches, over and over;
  --proc   what a process on the same machine can do: read /proc/net/tcp in
           a tight loop and connect to each new listening port at once;
  --hold HOST:PORT N  one known port (a relay's, a forwarded one): N idle
           connections to it at all times, each one the far end closes
           opened again.
Usage: port_stranger.py SECONDS (--sweep | --proc | --hold HOST:PORT N) [--garbage]
"""
import errno
import os
import select
import signal
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


def stop(*_):
    raise KeyboardInterrupt


def hold_idle(seconds, address, count):
    signal.signal(signal.SIGTERM, stop)  # a background job of a script ignores SIGINT
    end = time.time() + seconds
    held, up = {}, set()  # every connection; those connected
    opened = refused = peak = 0
    poller = select.poll()
    try:
        while time.time() < end:
            while len(held) < count:
                s = socket.socket()
                s.setblocking(False)
                if s.connect_ex(address) not in (0, errno.EINPROGRESS):
                    s.close()
                    break
                held[s.fileno()] = s
                poller.register(s, select.POLLIN | select.POLLOUT)
                opened += 1
            # Connected: it waits. What the far end sends (a challenge) is read and ignored; a close is opened again.
            turned_away = False
            for fd, events in poller.poll(100):
                s = held[fd]
                if events & select.POLLOUT and fd not in up and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    up.add(fd)
                    poller.modify(fd, select.POLLIN)
                    continue
                try:
                    gone = (events & (select.POLLHUP | select.POLLERR)) or not s.recv(4096)
                except OSError:
                    gone = True
                if gone:
                    if fd not in up:
                        refused += 1
                        turned_away = True
                    up.discard(fd)
                    poller.unregister(fd)
                    del held[fd]
                    s.close()
            peak = max(peak, len(up))
            if turned_away:  # nothing listens yet: an idle stranger tries again later, it does not flood
                time.sleep(0.5)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: how scripts/stranger_run.sh ends it
        pass
    print(f'stranger (--hold): {opened} connections opened to {address[0]}:{address[1]}, {refused} refused, '
          f'at most {peak} held at once', flush=True)


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ('--sweep', '--proc', '--hold'):
        sys.exit(__doc__.strip().splitlines()[-1])
    if sys.argv[2] == '--hold':
        if len(sys.argv) < 5:
            sys.exit(__doc__.strip().splitlines()[-1])
        host, port = sys.argv[3].rsplit(':', 1)
        return hold_idle(float(sys.argv[1]), (host, int(port)), int(sys.argv[4]))
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
