"""A user's tool file for the tool runtime's tests (tests/test_tools_*.py): TRL-style typed functions with
Google-style docstrings, misbehaving ones, and a stateful environment class. Copied into a temporary user folder
(GRPO_USER_DIR) by the tests, so it loads the way a user's own file does."""
import os
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def spin() -> str:
    """Loop forever on the CPU."""
    while True:
        pass


def crash(message: str) -> str:
    """Raise an error.

    Args:
        message: What the error says.
    """
    raise RuntimeError(message)


def die() -> str:
    """End the process that runs it, at once."""
    os._exit(3)


def chatty(n: int) -> str:
    """Return a long text.

    Args:
        n: How many characters.
    """
    return "x" * n


def allocate(megabytes: int) -> str:
    """Allocate memory and hold it.

    Args:
        megabytes: How much.
    """
    block = bytearray(megabytes * 2 ** 20)
    return f"allocated {len(block)}"


def write_file(name: str, megabytes: int) -> str:
    """Write a file in the working folder.

    Args:
        name: The file's name.
        megabytes: Its size.
    """
    with open(name, "wb") as f:
        f.write(b"0" * (megabytes * 2 ** 20))
    return os.path.abspath(name)


def list_folder() -> str:
    """The files in the working folder and the folder's path."""
    return f"{os.getcwd()}: {sorted(os.listdir('.'))}"


def untyped(a, b):
    return a


def no_args_doc(a: int) -> int:
    """Says nothing about its argument."""
    return a


class Counter:
    """A stateful environment: a counter per episode."""

    def __init__(self):
        self.value = 0

    def reset(self, **kwargs) -> str:
        self.value = int(kwargs.get("start", 0))
        return f"The counter starts at {self.value}."

    def add(self, amount: int) -> int:
        """Add to the counter and return its value.

        Args:
            amount: How much to add.
        """
        self.value += amount
        return self.value

    def get_reward(self) -> float:
        return float(self.value)

    def _private(self) -> None:
        pass


async def shout(text: str) -> str:
    """Say it louder (an async tool, as TRL takes).

    Args:
        text: What to say.
    """
    return text.upper()


_QUEUE = None  # made at the first call, bound to the loop that call ran on: a second loop cannot use it


async def echo_later(text: str) -> str:
    """Say it back a moment later, through a queue kept across calls (a loop-bound client, as a judge keeps one).

    Args:
        text: What to say.
    """
    import asyncio
    global _QUEUE
    _QUEUE = _QUEUE or asyncio.Queue()
    asyncio.get_running_loop().call_later(0.01, _QUEUE.put_nowait, text)
    return await _QUEUE.get()  # waits: binds the queue to the running loop


async def spin_async() -> str:
    """Never awaits: only ending its process stops it."""
    while True:
        pass


class Plain:
    """An environment without get_reward."""

    def reset(self, **kwargs) -> None:
        self.seen = []

    def note(self, text: str) -> int:
        """Remember a note and return how many there are.

        Args:
            text: The note.
        """
        self.seen.append(text)
        return len(self.seen)



class OnlyReset:
    """TRL accepts an environment whose only public method is reset (and get_reward): no tools."""

    instances = 0

    def __init__(self):
        OnlyReset.instances += 1
        self.id = OnlyReset.instances

    def reset(self, **kwargs) -> str:
        return f" (instance {self.id})"

    def get_reward(self) -> float:
        return float(self.id)


class Echo:
    """Says which keyword arguments reset() got (TRL passes the dataset row, less `environment` in the dict form)."""

    def reset(self, **kwargs) -> str:
        return repr(sorted(kwargs))


class Locked(Counter):
    """A Counter holding a lock: its instances cannot be pickled (no copy for TRL's `environments` keyword)."""

    def __init__(self):
        import threading

        super().__init__()
        self.lock = threading.Lock()
