"""``manage.py run_scheduler``: run the jobs until SIGTERM or Ctrl-C, then hand over."""

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from jobs.scheduler import scheduler


class Command(BaseCommand):
    """Run this process as one instance of the scheduler."""

    help = "Run the scheduled jobs; several processes may run this command at once."

    def handle(self, *args: Any, **options: Any) -> None:
        """Start the scheduler, wait for a stop signal, stop with a hand-over."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        with scheduler:
            self.stdout.write(f"instance {scheduler.instance_id} started")
            self.stdout.flush()
            stop.wait()
        self.stdout.write("stopped; runs still held were handed over")
