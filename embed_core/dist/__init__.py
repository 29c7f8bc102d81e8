"""How processes form a job: this process's place in it (``world``), the process group and its
collectives (``distributed``), work one rank does for all (``ranks``), and the local ranks a
training stage starts without a launcher (``spawn``, ``spawned``). Below every stage: the stage
registry asks ``ranks`` who decides a cache hit; it knows nothing of training."""
