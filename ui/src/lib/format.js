// How numbers, sizes and times read on the page.
import { Isolation } from "./protocol.js";

const ISOLATION_WORDS = { [Isolation.DOCKER]: "container", [Isolation.USER]: "per-job user", [Isolation.PROCESS]: "same user" };

/** How a slot keeps job code from its GPU client and other jobs, in words ("" when not told). */
export function formatIsolation(isolation) {
  if (!isolation) return "";
  return ISOLATION_WORDS[isolation] || isolation;
}

/** A container's image and limits (`Terms`, gpu_client/sandbox/container.py) on one line. */
export function formatTerms(t) {
  if (!t) return "";
  return [
    t.image,
    `memory ${formatBytes(t.memory_bytes)}`,
    `pids ${t.pids}`,
    `shm ${formatBytes(t.shm_bytes)}`,
    `${t.root_fs} root`,
    `capabilities ${t.capabilities}`,
    `network: ${t.network}`,
  ].join(" · ");
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "—";
  if (bytes === 0) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = bytes;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

/** Four significant digits, or an exponent for very small or large values. */
export function formatNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  if (!Number.isFinite(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  if (Number.isInteger(value)) return String(value);
  return String(Number(value.toPrecision(4)));
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 0) seconds = 0;
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  const m = Math.floor(seconds / 60);
  if (m < 60) return `${m} min ${String(Math.floor(seconds % 60)).padStart(2, "0")} s`;
  const h = Math.floor(m / 60);
  return `${h} h ${String(m % 60).padStart(2, "0")} min`;
}

const pad = (n) => String(n).padStart(2, "0");

/** A unix time (seconds) as local time: HH:MM:SS today, else YYYY-MM-DD HH:MM. */
export function formatTime(unix, now = Date.now() / 1000) {
  if (!unix) return "—";
  const d = new Date(unix * 1000);
  const today = new Date(now * 1000);
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === today.toDateString()) return hms;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms.slice(0, 5)}`;
}

export function formatAgo(unix, now = Date.now() / 1000) {
  if (!unix) return "never";
  const s = Math.max(0, now - unix);
  if (s < 5) return "just now";
  if (s < 60) return `${Math.floor(s)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

// bits per second, from bytes per second (a link's figures are bytes per second on the wire)
function formatRate(bytesPerSecond) {
  const bits = bytesPerSecond * 8;
  if (bits >= 1e9) return `${(bits / 1e9).toFixed(1)} Gbit/s`;
  if (bits >= 1e6) return `${Math.round(bits / 1e6)} Mbit/s`;
  return `${Math.round(bits / 1e3)} kbit/s`;
}

// A GPU client's link to the server, as it measured it at register; null when it did not.
export function formatLink(link) {
  if (!link) return null;
  return `↓ ${formatRate(link.down)} ↑ ${formatRate(link.up)} · rtt ${(link.rtt * 1000).toFixed(1)} ms`;
}
