"""What the earlier project's code calls, kept working: ``submit_job``'s seven positional
arguments in their order, ``parse_args()`` (``-rt/--room_token``) and ``get_logger()``; its result
word "complete" is ``results.ResultStatus``'s."""
from __future__ import annotations

import argparse
import functools
import logging
import os

from ..errors import BadRequest


#: ``submit_job``'s arguments that may be given by position, in the earlier project's order.
SUBMIT_POSITIONAL = ("model", "data_loader_func", "train_func", "eval_func", "optimizer", "parallelism",
                     "memory_required")


def positional_at_most(names: tuple[str, ...]):
    """Refuse more positional arguments than ``names`` with a TypeError that says what to do
    (Python's own would count ``self`` and name no argument)."""
    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if len(args) > len(names):
                raise TypeError(f"{method.__name__}() takes at most {len(names)} positional arguments "
                                f"({', '.join(names)}) but {len(args)} were given; pass the others by name, "
                                f"e.g. room_token=...")
            return method(self, *args, **kwargs)
        return call
    return decorate


class Compat:
    """``ZWDX``'s methods from the earlier project."""

    def parse_args(self, args: list[str] | None = None) -> argparse.Namespace:
        """The earlier project's command line: ``-rt/--room_token`` (required unless
        ``ZWDX_ROOM_TOKEN`` is set), a submitter token of the room. It becomes this object's
        default room token. ``--room-token-file F`` reads it from a file instead; a token on the
        command line warns, as every user of the machine can read it there."""
        from ..token_source import FILE_VARIABLE, TOKEN_VARIABLE, token_from
        given = bool(os.environ.get(TOKEN_VARIABLE) or os.environ.get(FILE_VARIABLE))
        parser = argparse.ArgumentParser(description="zwdx user argument parser.")
        parser.add_argument("-rt", "--room_token", "--room-token", dest="room_token", type=str, default=None,
                            help="a submitter token (zs_...) of the room to submit to; every user of the machine "
                                 "can read a command line, so prefer --room-token-file or $ZWDX_ROOM_TOKEN")
        parser.add_argument("--room-token-file", default=None, help="a file holding the submitter token")
        parsed = parser.parse_args(args)
        if not (parsed.room_token or parsed.room_token_file or given):
            parser.error("a room token is required: -rt/--room_token TOKEN, --room-token-file FILE or $ZWDX_ROOM_TOKEN")
        try:
            parsed.room_token = token_from(parsed.room_token, parsed.room_token_file, parser.prog)
        except BadRequest as err:
            parser.error(err.message)
        self.room_token = parsed.room_token or self.room_token
        return parsed

    def get_logger(self) -> logging.Logger:
        """The "zwdx" logger, printing INFO lines to stderr (the SDK's own lines too). Calling
        it again adds no second handler; its lines do not also go to the root logger."""
        logger = logging.getLogger("zwdx")
        logger.setLevel(logging.INFO)
        if not any(getattr(h, "zwdx_handler", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
            handler.zwdx_handler = True
            logger.addHandler(handler)
        logger.propagate = False
        return logger

