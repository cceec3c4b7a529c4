"""The `noloco` command of a pip-installed noloco: the executable beside this package."""
import os
import sys


def main():
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "noloco")
    os.execv(binary, [binary] + sys.argv[1:])
