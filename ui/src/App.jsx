// Routes and the signed-in layout. Everything but /signin needs a room token.
import { Component } from "react";
import { Navigate, NavLink, Outlet, Route, Routes, useLocation } from "react-router-dom";
import { AuthProvider, useAuth } from "./lib/auth.jsx";
import { LiveProvider } from "./lib/LiveProvider.jsx";
import ConnectionBanner, { ConnectionDot } from "./components/ConnectionBanner.jsx";
import { Notice } from "./components/bits.jsx";
import History from "./pages/History.jsx";
import JobPage from "./pages/JobPage.jsx";
import Overview from "./pages/Overview.jsx";
import SignIn from "./pages/SignIn.jsx";

class ErrorBoundary extends Component {
  state = { error: null };
  static getDerivedStateFromError(error) {
    return { error };
  }
  render() {
    if (this.state.error) {
      return (
        <Notice kind="error" title="Something went wrong on this page">
          {String(this.state.error.message || this.state.error)}{" "}
          <button type="button" className="button-secondary" onClick={() => this.setState({ error: null })}>
            Try again
          </button>
        </Notice>
      );
    }
    return this.props.children;
  }
}

function SignedIn() {
  const { token, room, signOut } = useAuth();
  const location = useLocation();
  if (!token) return <Navigate to="/signin" replace state={{ from: location.pathname }} />;
  return (
    <LiveProvider token={token} onRefused={(msg) => signOut(`The server refused the room token: ${msg}`)}>
      <header className="topbar">
        <span className="brand-mark">zwdx</span>
        <span className="room-name" data-testid="room-name">
          {room?.name || "…"}
        </span>
        <nav>
          <NavLink to="/" end>
            Overview
          </NavLink>
          <NavLink to="/history">History</NavLink>
        </nav>
        <ConnectionDot />
        <button type="button" className="button-secondary" onClick={() => signOut(null)}>
          Sign out
        </button>
      </header>
      <ConnectionBanner />
      <main className="content">
        <ErrorBoundary key={location.pathname}>
          <Outlet />
        </ErrorBoundary>
      </main>
    </LiveProvider>
  );
}

function NotFound() {
  return <Notice kind="error" title="No such page">Use the links above.</Notice>;
}

export function AppRoutes() {
  return (
    <Routes>
      <Route path="/signin" element={<SignIn />} />
      <Route element={<SignedIn />}>
        <Route index element={<Overview />} />
        <Route path="/jobs/:jobId" element={<JobPage />} />
        <Route path="/history" element={<History />} />
        <Route path="*" element={<NotFound />} />
      </Route>
    </Routes>
  );
}

export default function App() {
  return (
    <AuthProvider>
      <AppRoutes />
    </AuthProvider>
  );
}
