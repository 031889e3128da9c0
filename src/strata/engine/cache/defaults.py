"""The expert cache's defaults, in a module that imports nothing (no torch), so that the command
line's help can name them without loading the engine."""

DEFAULT_SHORT_READ = 64  # prompt parts longer than this many tokens take the loan
DEFAULT_KEEP_SLOTS = 128  # slots a loan never takes: the hottest experts stay for the prompt
DEFAULT_MAX_FRACTION = 0.85  # the most of the arena a loan takes
DEFAULT_UPLOAD_BATCHES = 4  # a loaned layer's misses upload in this many batches, pipelined
