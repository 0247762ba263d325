"""`mcar <tool> --help`: the tool's conf files as written, its own keys first with the comments that explain them,
then the keys of the configs it builds on and its groups with their options (no torch, no composition)."""
from __future__ import annotations

from mcar.hydra_app import CONF_DIR


def usage_exit(config_name: str) -> None:
    """`mcar <tool> --help`: the tool's keys with their comments (tool_help); exits 0."""
    print(tool_help(config_name))
    raise SystemExit(0)


def split_config_text(text: str) -> tuple[list[str], list[str]]:
    """A conf file's lines -> (its `defaults:` entries, its own lines: keys with their comments, less the defaults
    list and the `hydra:` block, which are Hydra's)."""
    defaults, own, block = [], [], None
    for line in text.splitlines():
        top = line[:1] not in ("", " ", "#")
        if top:
            block = line.split(":", 1)[0]
        if block == "defaults" and not top:
            if line.strip().startswith("- "):
                defaults.append(line.strip()[2:])
            continue
        if block not in ("defaults", "hydra"):
            own.append(line)
    while own and not own[-1].strip():
        own.pop()
    return defaults, own


def tool_help(config_name: str) -> str:
    """What `mcar <tool> --help` prints, read from the conf files as written (their comments explain each key), no
    composition (it answers at once): the tool's own keys first, then the configs it builds on (their keys), then
    its groups with their options. The composed config: `mcar <tool> --cfg job`."""
    seen, sections, groups = set(), [], []

    def read(name: str, heading: str) -> None:
        path = CONF_DIR / f"{name}.yaml"
        if name in seen or not path.is_file():
            return
        seen.add(name)
        defaults, own = split_config_text(path.read_text())
        if any(line.strip() for line in own):
            sections.append(f"\n{heading} (conf/{name}.yaml):\n" + "\n".join("  " + line if line else ""
                                                                           for line in own))
        for entry in defaults:
            choice, _, comment = entry.partition("#")
            if ":" in choice and not choice.startswith(("override ", "_")):
                group, option = (x.strip() for x in choice.split(":", 1))
                groups.append((group.lstrip("/"), option, comment.strip()))
            elif choice.strip() and not choice.strip().startswith("_"):
                read(choice.strip(), f"keys from {choice.strip()}")

    read(config_name, f"mcar {config_name}'s own keys")
    lines = [f"usage: mcar {config_name} key=value ... group=option ...  (Hydra overrides)", *sections]
    if groups:
        lines += ["", "groups (group=option; a group's keys as group.key=value, its files in conf/<group>/):"]
        for group, option, comment in dict.fromkeys(groups):
            folder = CONF_DIR / group.split("@")[0]
            options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
            said = f"  # {comment}" if comment else ""
            lines.append(f"  {group}={option}  (options: {', '.join(options) or '-'}){said}")
    lines += ["", f"the composed config, every value resolved: mcar {config_name} --cfg job   "
                  f"(Hydra's own flags: --hydra-help)"]
    return "\n".join(lines)
