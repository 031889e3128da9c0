"""A plugin that keeps every `strata_event` it is told, in order, for the tests to read."""

from strata.policies import hookimpl


class EventLog:
    def __init__(self):
        self.seen = []

    @hookimpl
    def strata_event(self, event):
        self.seen.append(event)
