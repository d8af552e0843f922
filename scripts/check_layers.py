#!/usr/bin/env python3
"""Checks every #include in src/ and include/cohort/ against src/LAYERS.

Usage: check_layers.py SOURCE_DIR [--list]

A file in src/LAYER/ may include headers of its own layer and of the layers src/LAYERS lists after
LAYER's colon; a public header include/cohort/X.h counts as the layer that implements it (the
`public` lines). Public headers may include only public headers of their own or lower layers.
Exits 1 naming each upward include as FILE:LINE, 0 when there is none. --list prints, for each
layer, the layers its files include.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def read_layers(path):
    allowed, owner, order = {}, {}, []
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split('#', 1)[0].strip()
            if not line:
                continue
            head, _, rest = line.partition(':')
            words = rest.split()
            if head.startswith('public '):
                layer = head.split()[1]
                for header in words:
                    owner['cohort/' + header] = layer
                continue
            layer = head.strip()
            for lower in words:
                if lower not in allowed:
                    sys.exit(f'{path}:{number}: layer {layer} uses {lower}, which is not declared above it')
            allowed[layer] = set(words)
            order.append(layer)
    for layer in owner.values():
        if layer not in allowed:
            sys.exit(f'{path}: public headers are given to {layer}, which is not a layer')
    return allowed, owner, order


def layer_of_include(name, owner, layers):
    """The layer an #include names, or None for one that is not cohort's (torch, std, ...)."""
    if name in owner:
        return owner[name]
    if name.startswith('cohort/'):
        return '?'  # a public header src/LAYERS does not place
    first = name.split('/', 1)[0]
    if '/' in name and first in layers:
        return first
    return None


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    listing = '--list' in sys.argv[2:]
    allowed, owner, order = read_layers(os.path.join(root, 'src', 'LAYERS'))
    problems, uses = [], {layer: set() for layer in order}
    files = []
    for layer in sorted(os.listdir(os.path.join(root, 'src'))):
        folder = os.path.join(root, 'src', layer)
        if not os.path.isdir(folder):
            continue
        if layer not in allowed:
            problems.append(f'src/{layer}/: a folder that src/LAYERS does not declare')
            continue
        for dirpath, _, names in os.walk(folder):
            files += [(layer, os.path.join(dirpath, n)) for n in sorted(names) if n.endswith(('.h', '.cpp'))]
    public_dir = os.path.join(root, 'include', 'cohort')
    for name in sorted(os.listdir(public_dir)):
        header = 'cohort/' + name
        if header not in owner:
            problems.append(f'include/{header}: src/LAYERS gives it to no layer (add it to a `public` line)')
            continue
        files.append((owner[header], os.path.join(public_dir, name)))
    for layer, path in files:
        public = path.startswith(public_dir)
        with open(path, errors='replace') as f:
            for number, line in enumerate(f, 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                name = match.group(1)
                target = layer_of_include(name, owner, allowed)
                if target is None:
                    continue
                where = f'{os.path.relpath(path, root)}:{number}'
                if target == '?':
                    problems.append(f'{where}: includes {name}, which src/LAYERS gives to no layer')
                    continue
                if public and not name.startswith('cohort/'):
                    problems.append(f'{where}: a public header includes {name} from src/ (consumers do not have src/)')
                    continue
                if target != layer:
                    uses[layer].add(target)
                    if target not in allowed[layer]:
                        problems.append(f'{where}: layer {layer} includes {name} of layer {target}, '
                                        f'which src/LAYERS does not put below {layer}')
    if listing:
        for layer in order:
            print(f'{layer}: {" ".join(l for l in order if l in uses[layer])}')
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f'check_layers: {len(problems)} include(s) break the layers of src/LAYERS', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
