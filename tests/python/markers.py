"""Files the processes of a Python test leave for each other to wait on."""
import os
import time


def wait_for(path, seconds, poll=0.05):
    """Until `path` exists (a marker another process writes); False after `seconds`."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True
