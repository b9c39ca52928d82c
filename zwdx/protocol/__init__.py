"""The protocol shared by the SDK, the server, the GPU client and the dashboard.

    vocab.py    statuses and kinds (str enums), job status groups, the arguments offered to the
                submitter's functions, runtime versions
    events.py   Socket.IO namespaces and event names
    base.py     how messages are declared (pydantic v2) and checked: Message, Answer, parse
    gpu.py      the /gpu namespace's payloads: Register, Heartbeat, RanksExited, JobAssign, ...
    job.py      a job's record, declared once (Job, JobSpec, RankState, ...) and what is shown of it
                (JobView)
    rest.py     the REST API's bodies, answers and queries (the OpenAPI spec is made from them)
    report.py   what a job's rank processes report over REST: events, their status, checkpoints
    checkpoint.py
                the files of each checkpoint format, and which rank writes each one
    rank.py     what a GPU client hands each rank process, once, on its stdin: RankSpec
    diloco.py   DILOCO's settings (DilocoSettings) and the state of one of its rounds (RoundState)
    layout.py   what a rank holds of the model (RankLayout), for the job's page to draw
    dataset.py  a room's datasets (Manifest, its versions) and what a job pins of them (DatasetPin)
    catalog.py  every Socket.IO event with its payload and answer types (docs/events.md)

Import the message modules by name (``from zwdx.protocol.gpu import Register``); the package
itself re-exports the vocabulary only, which needs nothing beyond the standard library.

Nothing here imports the server or torch, so every side can depend on it.
"""
from .events import *  # noqa: F401,F403
from .events import __all__ as _events_all
from .vocab import *  # noqa: F401,F403
from .vocab import __all__ as _vocab_all

__all__ = [*_vocab_all, *_events_all]
