"""Lightning-free runtime: the optimizer step (:mod:`.engine`), the DP x CP process groups
(:mod:`.process_groups`), the memory fit of ``bucket_size="auto"`` (:mod:`.memory`) and the
local multi-process launcher (:mod:`.launch`)."""
