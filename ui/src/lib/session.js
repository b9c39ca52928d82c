// The room token lives in this tab's sessionStorage: sent in a header on each request, never in a URL.
const KEY = "zwdx.roomToken";

export function getToken() {
  try {
    return window.sessionStorage.getItem(KEY);
  } catch {
    return null;
  }
}

export function setToken(token) {
  window.sessionStorage.setItem(KEY, token);
}

export function clearToken() {
  window.sessionStorage.removeItem(KEY);
}
