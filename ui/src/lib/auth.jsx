// Who is signed in: the room token (sessionStorage) and the room it opens.
import { createContext, useCallback, useContext, useEffect, useMemo, useState } from "react";
import { api, setUnauthorizedHandler } from "./api.js";
import { clearToken, getToken, setToken } from "./session.js";

const AuthContext = createContext(null);

export function AuthProvider({ children }) {
  const [token, setTokenState] = useState(() => getToken());
  const [room, setRoom] = useState(null);
  const [notice, setNotice] = useState(null); // why the user was signed out

  const signOut = useCallback((message = null) => {
    clearToken();
    setTokenState(null);
    setRoom(null);
    setNotice(message);
  }, []);

  /** Checks the token with the server before keeping it; throws ApiError when it opens no room. */
  const signIn = useCallback(async (candidate) => {
    const trimmed = candidate.trim();
    const info = await api.room(trimmed);
    setToken(trimmed);
    setTokenState(trimmed);
    setRoom({ id: info.id, name: info.name, created_at: info.created_at });
    setNotice(null);
    return info;
  }, []);

  useEffect(() => {
    setUnauthorizedHandler((message) => signOut(`The server no longer accepts this room token: ${message}`));
    return () => setUnauthorizedHandler(null);
  }, [signOut]);

  // A reload keeps the token (same tab): fetch the room it opens.
  useEffect(() => {
    if (!token || room) return;
    let live = true;
    api.room(token).then(
      (info) => live && setRoom({ id: info.id, name: info.name, created_at: info.created_at }),
      () => {}, // a 401 signs out through the handler; other errors show on the pages
    );
    return () => {
      live = false;
    };
  }, [token, room]);

  const value = useMemo(() => ({ token, room, notice, signIn, signOut }), [token, room, notice, signIn, signOut]);
  return <AuthContext.Provider value={value}>{children}</AuthContext.Provider>;
}

export function useAuth() {
  return useContext(AuthContext);
}
