"""nbclient's NotebookClient, except that a wait for a kernel message is cut into slices.

Used by the book build's parallel execution (parallel_execution.py) and the tests' torch pass
(tests/test_notebooks_on_torch.py).
"""
import math
import time
from queue import Empty

from nbclient import NotebookClient

SLICE_S = 1.0  # the client looks at its sockets at least this often


class PatientClient(NotebookClient):
    """nbclient, except that a wait for a kernel message is cut into SLICE_S slices.

    A reply can sit on the client's socket without waking it: the sockets' file descriptors
    are edge-triggered, and an edge the event loop misses leaves the wait to run to its timeout,
    whose last look finds the message. Seen here under load: a cell that ran in 1.5 s was
    answered after exactly 300.008 s, the cell timeout, and passed; in a book build two at a
    time, chapter 03 took 336 s for 30 s of work. Each slice ends with such a
    look, so a missed edge costs at most SLICE_S; `late` counts the messages found that way."""

    late = 0

    async def async_start_new_kernel_client(self):
        client = await super().async_start_new_kernel_client()
        for channel in (client.shell_channel, client.iopub_channel):
            channel.get_msg = self.in_slices(channel.get_msg)
        return client

    def in_slices(self, get_msg):
        async def get_msg_in_slices(timeout=None):
            remaining = math.inf if timeout is None else timeout
            while True:
                step = min(SLICE_S, remaining)
                began = time.monotonic()
                try:
                    message = await get_msg(timeout=step)
                except Empty:
                    remaining -= time.monotonic() - began
                    if remaining <= 0:
                        raise
                    continue
                if time.monotonic() - began >= step:  # found by the slice's last look
                    self.late += 1
                return message
        return get_msg_in_slices
