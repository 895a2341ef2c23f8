"""Hugging Face Hub repository ids as model folders, through ``huggingface_hub``'s own cache.

A trainer config's ``model.pretrained`` (and :func:`local_folder`'s argument) is either a local folder
or a hub repository id, ``owner/name`` with an optional ``@revision``. A repository id is resolved by
``huggingface_hub.snapshot_download``: from its local cache when the machine is offline
(``HF_HUB_OFFLINE=1``) or the files are there, downloading otherwise. Only the files a model folder
needs are fetched: ``config.json``, the safetensors weights and their index, the tokenizer and
generation files.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> local_folder(d) == d          # an existing folder is itself
True
>>> is_repo_id("Qwen/Qwen3-30B-A3B"), is_repo_id("./runs/x"), is_repo_id("a/b/c")
(True, False, False)
"""

from __future__ import annotations

import os
import re

# what a Hugging Face model folder holds that hpfunc reads or carries through an export
FOLDER_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")

# the tokenizer and generation files among them, which an export copies from the source folder
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?")


class HubError(ValueError):
    """A repository id that cannot be resolved to a local folder (not cached offline, unknown, no library)."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a hub repository id (``owner/name[@revision]``), not a path."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith((".", "/", "~"))


def local_folder(name_or_path: str | os.PathLike) -> str:
    """The local folder of ``name_or_path``: the path itself when it is a folder, else the snapshot of
    the hub repository it names (see the module docstring). Raises :class:`HubError` with the reason."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path) or not is_repo_id(path):
        return path
    repo_id, _, revision = path.partition("@")
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise HubError(f"{path!r} is neither a folder nor resolvable: reading a hub repository id needs "
                       f"huggingface_hub (pip install 'hpfunc[hub]'), or pass a local folder") from None
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision or None,
                                                 allow_patterns=list(FOLDER_FILES))
    except LocalEntryNotFoundError:
        raise HubError(f"{path!r} is not a folder, and the hub repository {repo_id!r} is not in the local "
                       f"cache ({constants.HF_HUB_CACHE}) while offline; download it first "
                       f"(huggingface-cli download {repo_id}) or pass a local folder") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(f"{path!r} is not a folder, and the hub repository {repo_id!r} could not be read: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
