# Sourced by the install_*.sh scripts: pypi_fetch PROJECT FILENAME puts FILENAME from PyPI into the
# current folder, checked against the sha256 PyPI lists; a file already there is kept.
# It reads PyPI's simple index (JSON form) rather than `pip download`, which would build an sdist's
# metadata and, with --no-binary, its build deps (cmake) too.
pypi_fetch() {
  local project="$1" file="$2" url sha
  [ -s "$file" ] && return 0
  read -r url sha < <(curl -fsS -H 'Accept: application/vnd.pypi.simple.v1+json' \
    "https://pypi.org/simple/$project/" | "${PY:-python3}" -c "
import json, sys
for f in json.load(sys.stdin)['files']:
    if f['filename'] == sys.argv[1]:
        print(f['url'], f['hashes']['sha256'])" "$file") || true  # nothing listed: the message below says so
  [ -n "${url:-}" ] || { echo "PyPI lists no $file" >&2; return 1; }
  curl -fsSL -o "$file.part" "$url"
  echo "$sha  $file.part" | sha256sum -c - >&2
  mv "$file.part" "$file"
}
