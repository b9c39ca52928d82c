// Renders the whole app at a route, signed in with a token (or not), against mocked fetch/socket.
import { render } from "@testing-library/react";
import { MemoryRouter } from "react-router-dom";
import { AppRoutes } from "../App.jsx";
import { AuthProvider } from "../lib/auth.jsx";
import { setToken } from "../lib/session.js";

export function renderApp(path, { token = "zr_good" } = {}) {
  if (token) setToken(token);
  return render(
    <MemoryRouter initialEntries={[path]}>
      <AuthProvider>
        <AppRoutes />
      </AuthProvider>
    </MemoryRouter>,
  );
}

export const ROOM = { id: "r1", name: "lab", created_at: 1700000000, clients: [] };
