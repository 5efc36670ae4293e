"""A small kustomize, for rendering ``deploy/kustomize`` where the real tool is not installed.

It implements only the subset the manifests use, and refuses everything else (an unknown
kustomization field, a JSON 6902 patch, a list it cannot merge faithfully) with ``KustomizeError``,
so the manifests cannot drift out of what it renders correctly. Where ``kubectl`` is available,
``tests/test_deploy.py`` checks that this renders exactly what ``kubectl kustomize`` renders.

Supported:

* ``resources``: YAML files (several documents each) and directories holding a kustomization;
* ``patches``: strategic-merge patches from ``path`` (several documents each, names inferred from
  each document) or with a ``target`` (``kind``, ``name``, equality-only ``labelSelector``);
  maps merge recursively (``null`` deletes a key); ``args`` / ``command`` are replaced whole;
  ``containers``, ``initContainers``, ``env``, ``volumes`` (by ``name``), ``volumeMounts`` (by
  ``mountPath``) and container ``ports`` (by ``containerPort``) merge by key, the patch's elements
  first and then the base's others (kustomize's order); ``$patch: delete`` removes a list element
  or, alone in its file (kustomize 5.5 crashes on several), a whole object;
* ``replicas`` (``name``, ``count``) and ``images`` (``name``, ``newName``, ``newTag``, ``digest``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["KustomizeError", "build", "object_id"]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_FIELDS = {"apiVersion", "kind", "resources", "patches", "replicas", "images"}
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",  # container ports only: a Service's ports are refused below
}
_REPLACED_LISTS = {"args", "command"}
_SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet"}
_POD_SPEC_PATHS = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
}

Obj = dict[str, Any]


class KustomizeError(ValueError):
    """The kustomization uses something outside the supported subset, or is inconsistent."""


def object_id(obj: Obj) -> tuple[str, str, str]:
    """(group, kind, name): what kustomize matches patches and replicas by (no namespaces here)."""
    api_version = str(obj.get("apiVersion", ""))
    group = api_version.rpartition("/")[0]
    return group, str(obj.get("kind", "")), str(obj.get("metadata", {}).get("name", ""))


def build(directory: Path) -> list[Obj]:
    """Render the kustomization in ``directory`` to a list of objects (in resource order)."""
    kustomization = _read_kustomization(directory)
    objects: list[Obj] = []
    for entry in kustomization.get("resources") or []:
        path = directory / entry
        objects.extend(build(path) if path.is_dir() else _read_documents(path))
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        if object_id(obj) in seen:
            raise KustomizeError(f"{directory}: duplicate object {object_id(obj)}")
        seen.add(object_id(obj))
    for patch in kustomization.get("patches") or []:
        objects = _apply_patch_entry(directory, patch, objects)
    for replica in kustomization.get("replicas") or []:
        _apply_replicas(directory, replica, objects)
    for image in kustomization.get("images") or []:
        _apply_image(image, objects)
    return objects


def _read_kustomization(directory: Path) -> Obj:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            unknown = set(data) - _FIELDS
            if unknown:
                raise KustomizeError(f"{path}: fields outside the supported subset: {sorted(unknown)}")
            if data.get("kind", "Kustomization") != "Kustomization":
                raise KustomizeError(f"{path}: kind must be Kustomization")
            return dict(data)
    raise KustomizeError(f"{directory}: no kustomization file")


def _read_documents(path: Path) -> list[Obj]:
    documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict) or not doc.get("kind") or not doc.get("metadata", {}).get("name"):
            raise KustomizeError(f"{path}: every document needs a kind and metadata.name")
    return documents


def _apply_patch_entry(directory: Path, entry: Obj, objects: list[Obj]) -> list[Obj]:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown or ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{directory}: a patch needs exactly one of path/patch (and maybe target)")
    text = (directory / entry["path"]).read_text(encoding="utf-8") if "path" in entry else entry["patch"]
    documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    if any(not isinstance(doc, dict) for doc in documents):
        raise KustomizeError(f"{directory}: {entry}: JSON 6902 patches are not supported")
    deletes = [doc for doc in documents if doc.get("$patch") == "delete"]
    if deletes and len(documents) > 1:
        raise KustomizeError(f"{directory}: {entry}: put a whole-object `$patch: delete` alone in its file")
    for doc in documents:
        targets = (
            _select(objects, entry["target"], directory)
            if "target" in entry
            else [obj for obj in objects if object_id(obj) == object_id(doc)]
        )
        if not targets:
            raise KustomizeError(f"{directory}: patch {entry} matches no object")
        if doc.get("$patch") == "delete":
            objects = [obj for obj in objects if not any(obj is target for target in targets)]
            continue
        for target in targets:
            patch = copy.deepcopy(doc)
            if "target" in entry:  # kustomize ignores the patch's own name when a target is given
                patch.pop("metadata", None)
            merged = _merge_map(target, patch, target["kind"], ())
            target.clear()
            target.update(merged)
    return objects


def _select(objects: Iterable[Obj], target: Obj, directory: Path) -> list[Obj]:
    unknown = set(target) - {"kind", "name", "labelSelector"}
    if unknown:
        raise KustomizeError(f"{directory}: target fields outside the supported subset: {sorted(unknown)}")
    wanted: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in str(target.get("labelSelector", "")).split(","))):
        key, sep, value = term.partition("=")
        if not sep or value.startswith("=") or key.endswith("!"):
            raise KustomizeError(f"{directory}: only equality label selectors are supported: {term!r}")
        wanted[key.strip()] = value.strip()
    selected = []
    for obj in objects:
        labels = obj.get("metadata", {}).get("labels") or {}
        if "kind" in target and obj.get("kind") != target["kind"]:
            continue
        if "name" in target and obj["metadata"]["name"] != target["name"]:
            continue
        if all(labels.get(key) == value for key, value in wanted.items()):
            selected.append(obj)
    return selected


def _merge_map(base: Obj, patch: Obj, kind: str, path: tuple[str, ...]) -> Obj:
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if key.startswith("$"):
            raise KustomizeError(f"{'.'.join(path)}: directive {key} outside the supported subset")
        where = (*path, key)
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict):
            current = merged.get(key)
            merged[key] = _merge_map(current if isinstance(current, dict) else {}, value, kind, where)
        elif isinstance(value, list):
            merged[key] = _merge_list(merged.get(key), value, kind, where)
        else:
            merged[key] = value
    return merged


def _merge_list(base: list[Any] | None, patch: list[Any], kind: str, path: tuple[str, ...]) -> list[Any]:
    key = path[-1]
    if key in _REPLACED_LISTS:
        return copy.deepcopy(patch)
    merge_key = _MERGE_KEYS.get(key)
    if merge_key is None or (kind == "Service" and key == "ports"):
        raise KustomizeError(f"{'.'.join(path)}: cannot merge this list faithfully; outside the subset")
    # As kustomize orders the result: the patch's elements first, in its order (each merged into
    # its namesake from the base), then the base's other elements, in theirs.
    remaining = copy.deepcopy(base or [])
    merged = []
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise KustomizeError(f"{'.'.join(path)}: every element needs its merge key {merge_key}")
        index = next((i for i, old in enumerate(remaining) if old.get(merge_key) == item[merge_key]), None)
        original = remaining.pop(index) if index is not None else None
        directive = item.get("$patch")
        if directive == "delete":
            continue
        if directive is not None:
            raise KustomizeError(f"{'.'.join(path)}: $patch: {directive} outside the supported subset")
        merged.append(copy.deepcopy(item) if original is None else _merge_map(original, item, kind, path))
    return merged + remaining


def _apply_replicas(directory: Path, replica: Obj, objects: list[Obj]) -> None:
    matched = [
        obj for obj in objects if obj["kind"] in _SCALABLE and obj["metadata"]["name"] == replica["name"]
    ]
    if not matched:
        raise KustomizeError(f"{directory}: replicas entry {replica} matches no workload")
    for obj in matched:
        obj.setdefault("spec", {})["replicas"] = int(replica["count"])


def _apply_image(image: Obj, objects: list[Obj]) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"images: fields outside the supported subset: {sorted(unknown)}")
    for container in _containers(objects):
        name, tag, digest = _split_image(container["image"])
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
            continue
        tag = str(image["newTag"]) if "newTag" in image else tag
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def _containers(objects: Iterable[Obj]) -> Iterable[Obj]:
    for obj in objects:
        spec: Any = obj
        for part in _POD_SPEC_PATHS.get(obj.get("kind", ""), ()):
            spec = spec.get(part) or {}
        if obj.get("kind") in _POD_SPEC_PATHS:
            yield from spec.get("initContainers") or []
            yield from spec.get("containers") or []
