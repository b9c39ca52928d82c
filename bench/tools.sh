#!/usr/bin/env bash
# Pack this host's redis-server and haproxy (Debian's packages) with the shared libraries they
# load into DIR (default .tools), for a bench host that has neither and no package registry (the
# device machines): carry DIR, then `export PATH=$PWD/DIR/bin:$PATH` there. glibc itself stays
# the host's (the target's must be as new or newer: Debian 12 has 2.36).
#   bench/tools.sh [DIR]
set -euo pipefail
dir=${1:-.tools}
rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/libexec" "$dir/lib"
for tool in redis-server haproxy; do
  path=$(command -v "$tool") || { echo "bench/tools.sh: $tool is not installed (apt-get install -y redis-server haproxy)" >&2; exit 1; }
  cp "$path" "$dir/libexec/$tool"
  ldd "$path" | awk '/=> \//{print $3}' | grep -Ev '/(libc|libm|libpthread|libdl|librt)\.so' | xargs -r cp -n -t "$dir/lib"
  cat > "$dir/bin/$tool" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/..
LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/libexec/$tool" "\$@"
WRAP
  chmod +x "$dir/bin/$tool"
done
"$dir/bin/redis-server" --version
"$dir/bin/haproxy" -v | head -1
du -sh "$dir"
