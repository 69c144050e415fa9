# shellcheck shell=bash
# Sourceable environment for running kvhandoff against the NIXL runtime.
#
#   source scripts/nixl-env.sh
#
# Points the dynamic loader and NIXL at the runtime libraries of the pinned
# `nixl-cu12` wheel (installed by scripts/test.sh into NIXL_HOME, outside the
# repo). This file installs nothing, never exits the calling shell and is safe
# to source more than once (LD_LIBRARY_PATH is not grown on every source).
#
# Exports:
#   NIXL_HOME        where the wheel is unpacked (respected if already set)
#   LD_LIBRARY_PATH  prepended with $NIXL_HOME/.nixl_cu12.mesonpy.libs, where
#                    libnixl_capi.so lives: nixl-sys is built with `stub-api`
#                    and dlopen()s that library at run time
#   NIXL_PLUGIN_DIR  $NIXL_HOME/.nixl_cu12.mesonpy.libs/plugins (the UCX plugin)
#
# UCX_TLS is deliberately left alone: shared-memory transports (sm, posix,
# cma-only) are refused on the reference machine and backend creation fails;
# left unset, UCX picks TCP (+ CMA) on loopback by itself.

KVHANDOFF_NIXL_VERSION="${KVHANDOFF_NIXL_VERSION:-1.5.1}"
export NIXL_HOME="${NIXL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/nixl-cu12-${KVHANDOFF_NIXL_VERSION}}"

__kvh_nixl_lib="$NIXL_HOME/.nixl_cu12.mesonpy.libs"

case ":${LD_LIBRARY_PATH:-}:" in
    *":$__kvh_nixl_lib:"*) ;;
    *) export LD_LIBRARY_PATH="$__kvh_nixl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
export NIXL_PLUGIN_DIR="$__kvh_nixl_lib/plugins"

if [ ! -f "$__kvh_nixl_lib/libnixl_capi.so" ]; then
    echo "nixl-env.sh: warning: $__kvh_nixl_lib/libnixl_capi.so not found;" \
        "run scripts/test.sh (or set NIXL_HOME) to install nixl-cu12==$KVHANDOFF_NIXL_VERSION" >&2
fi
unset __kvh_nixl_lib
