//! The Lua scripts. Each one runs atomically on the server, so a read-decide-write cannot
//! interleave with another worker's.
//!
//! Record encoding (one Redis string per key, see [`crate::codec`]):
//!
//! ```text
//! i1|<status 0|1|2>|<token>|<payload hex?>|<worker len?>|<worker>|<lease_until>|<attempts>|<first_seen>|<completed?>|<expires?>|<'-' | '+'<result bytes>>
//! ```
//!
//! The identity part (token, payload hash, worker) comes first, so every rewrite keeps it
//! as one substring. Times are milliseconds since the Unix epoch on **the server's clock**:
//! every script reads `TIME` itself (allowed in scripts since Redis 5, which replicate a
//! script's effects, not the script; on 3.2/4 the prelude switches effects replication on),
//! so consumers whose clocks disagree still agree on who holds a lease. `ARGV[1]` is unused
//! (it carried the client's time once; kept so the argument layouts stay put).

use std::sync::LazyLock;

const PRELUDE: &str = r#"
if redis.replicate_commands then pcall(redis.replicate_commands) end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function fmt(n) return string.format('%d', n) end
-- body: 'token|payload|wlen|worker|' (identity, kept by every rewrite); tail: result marker
local function parse(v)
  local st, tok, ph, wl, wpos = string.match(v, '^i1|([012])|(%d+)|(%x*)|(%d*)|()')
  if not st then return nil end
  local tpos = wpos + (tonumber(wl) or 0)
  local lu, att, fs, cm, ex, rpos = string.match(v, '^|(%d+)|(%d+)|(%d+)|(%d*)|(%d*)|()', tpos)
  if not lu then return nil end
  return { st = st, tok = tok, ph = ph, body = string.sub(v, 6, tpos), lus = lu,
           lu = tonumber(lu), atts = att, att = tonumber(att), fs = fs, cm = cm, ex = ex,
           tail = string.sub(v, rpos) }
end
"#;

/// The whole claim, atomically: `idemq_core::evaluate_claim`'s rules in Lua (retention
/// over → fresh; lease ended, by crash or release → takeover whatever the payload;
/// rolled back → refused whatever the payload; payload differs → conflict; completed →
/// duplicate; else in flight).
///
/// `KEYS` = the keys; `ARGV[1]` unused, `ARGV[2]` = in-progress grace ms; then per key its
/// lease ms and the identity part of its fresh record,
/// `i1|0|<token>|<payload hex or empty>|<worker len or empty>|<worker>|`.
///
/// Reply: the server's time (the leases acquired end there plus their lease ms), then a
/// flat list `[i, code, payload, ...]` naming only the keys that were *not* acquired fresh (`i` is the 1-based key index): code 1 re-acquired after release
/// (payload attempt), 2 takeover (payload attempt), 3 duplicate (payload record), 4 in
/// flight (payload lease end), 5 conflict (payload record), 6 the caller's own live lease
/// under the same token, a retried claim (payload record), 7 rolled back (payload record),
/// 9 unreadable value (payload reason; nothing written for that key). Every key not named was acquired, attempt 1.
const CLAIM_BODY: &str = r#"
local grace = tonumber(ARGV[2])
local nows = fmt(now)
local out = { now }
local n = 1
for i = 1, #KEYS do
  local k = KEYS[i]
  local lease = tonumber(ARGV[1 + 2 * i])
  local id = ARGV[2 + 2 * i]
  local lumid = fmt(now + lease) .. '|'
  local px = lease + grace
  local fresh = id .. lumid .. '1|' .. nows .. '|||-'
  if not redis.call('SET', k, fresh, 'NX', 'PX', px) then
    local v = redis.pcall('GET', k)
    local r = nil
    if type(v) == 'string' then r = parse(v) end
    local code, payload = nil, nil
    if not r then
      code = 9
      if type(v) == 'table' and v.err then payload = v.err else payload = 'not an idemq record' end
    elseif r.st ~= '0' and r.ex ~= '' and tonumber(r.ex) <= now then
      redis.call('SET', k, fresh, 'PX', px)
    elseif r.st == '0' and r.lu > now and r.tok == string.match(id, '^i1|0|(%d+)|') then
      -- Our own live lease (a retried claim whose first reply was lost): it is ours.
      code, payload = 6, v
    elseif r.st == '0' and r.lu <= now then
      -- An ended lease (crash or release) is taken over whatever payload it had.
      local att = r.att + 1
      redis.call('SET', k, id .. lumid .. fmt(att) .. '|' .. r.fs .. '|||-', 'PX', px)
      if r.lu > 0 then code = 2 else code = 1 end
      payload = att
    elseif r.st == '2' then
      code, payload = 7, v
    else
      local ph = string.match(id, '^i1|0|%d+|(%x*)|') or ''
      if r.ph ~= '' and ph ~= '' and r.ph ~= ph then
        code, payload = 5, v
      elseif r.st == '1' then
        code, payload = 3, v
      else
        code, payload = 4, r.lu
      end
    end
    if code then
      out[n + 1] = i
      out[n + 2] = code
      out[n + 3] = payload
      n = n + 3
    end
  end
end
return out
"#;

/// `KEYS` = the keys; `ARGV[1]` unused, `ARGV[2]` = completed grace ms; then per key:
/// token, retention ms, result field (`-` or `+<bytes>`). Reply: one integer per key,
/// 1 completed, 2 completed before by this token (idempotent: a retry whose reply was
/// lost), 0 fenced (another token, released, rolled back, or gone), 9 unreadable value.
const COMPLETE_BODY: &str = r#"
local nows = fmt(now)
local grace = tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS do
  local k = KEYS[i]
  local b = 2 + (i - 1) * 3
  local tok = ARGV[b + 1]
  local ret = tonumber(ARGV[b + 2])
  local res = ARGV[b + 3]
  local v = redis.pcall('GET', k)
  if type(v) ~= 'string' then
    if type(v) == 'table' then out[i] = 9 else out[i] = 0 end
  else
    local r = parse(v)
    if not r then
      out[i] = 9
    elseif r.tok ~= tok then
      out[i] = 0
    elseif r.st == '1' then
      out[i] = 2 -- completed before by this token: a retry whose reply was lost
    elseif r.st == '2' or r.lu == 0 then
      out[i] = 0 -- released: the token owns nothing
    else
      local nv = 'i1|1|' .. r.body .. r.lus .. '|' .. r.atts .. '|' .. r.fs .. '|' ..
        nows .. '|' .. fmt(now + ret) .. '|' .. res
      redis.call('SET', k, nv, 'PX', ret + grace)
      out[i] = 1
    end
  end
end
return out
"#;

/// The effect and the completion in one script: `KEYS[1]` = the record (the effect's keys
/// are arguments of its commands: in a cluster they must live on the record's node, which a
/// shared hash tag ensures); `ARGV` = unused, completed grace
/// ms, token, retention ms, result field, command count, then per command its argument
/// count and arguments. Reply: `{1}` applied and completed, `{2}` completed earlier by this
/// token (nothing applied again), `{0}` fenced (nothing applied), `{9}` unreadable record,
/// `{3, i, error}` command `i` failed (the ones before it stay applied: a script is atomic,
/// not transactional; the record is left in progress).
const COMPLETE_WITH_BODY: &str = r#"
local nows = fmt(now)
local k = KEYS[1]
local v = redis.pcall('GET', k)
if type(v) == 'table' then return {9} end
if not v then return {0} end
local r = parse(v)
if not r then return {9} end
if r.tok ~= ARGV[3] then return {0} end
if r.st == '1' then return {2} end
if r.st == '2' or r.lu == 0 then return {0} end
local a = 7
for c = 1, tonumber(ARGV[6]) do
  local n = tonumber(ARGV[a])
  local ok = redis.pcall(unpack(ARGV, a + 1, a + n))
  if type(ok) == 'table' and ok.err then return {3, c, ok.err} end
  a = a + n + 1
end
local ret = tonumber(ARGV[4])
local nv = 'i1|1|' .. r.body .. r.lus .. '|' .. r.atts .. '|' .. r.fs .. '|' ..
  nows .. '|' .. fmt(now + ret) .. '|' .. ARGV[5]
redis.call('SET', k, nv, 'PX', ret + tonumber(ARGV[2]))
return {1}
"#;

/// A batch's effects and completions in one script: `KEYS` = the records; `ARGV[1]`
/// unused, `ARGV[2]` = completed grace ms, then per key its token and retention ms, then
/// the effect commands as in [`COMPLETE_WITH_BODY`] (count, then each as length and
/// words). Every record is checked before anything is written: one lost lease (not the
/// token's, released) applies nothing. Reply `{1}` applied and completed, `{2}` every
/// record already completed by its token (a retried call: nothing applied again), `{0, i}`
/// the lease of key `i` lost, `{9, i}` key `i` unreadable, `{3, c, err}` effect command `c`
/// failed (the commands before it stay applied; no record is completed).
const COMPLETE_BATCH_WITH_BODY: &str = r#"
local nows = fmt(now)
local grace = tonumber(ARGV[2])
local nk = #KEYS
local recs = {}
local done = 0
for i = 1, nk do
  local v = redis.pcall('GET', KEYS[i])
  if type(v) == 'table' then return {9, i} end
  if not v then return {0, i} end
  local r = parse(v)
  if not r then return {9, i} end
  if r.tok ~= ARGV[1 + 2 * i] then return {0, i} end
  if r.st == '1' then
    done = done + 1
  elseif r.st == '2' or r.lu == 0 then
    return {0, i}
  end
  recs[i] = r
end
if done == nk then return {2} end
if done > 0 then return {9, 0} end
local a = 3 + 2 * nk
for c = 1, tonumber(ARGV[a]) do
  local n = tonumber(ARGV[a + 1])
  local ok = redis.pcall(unpack(ARGV, a + 2, a + 1 + n))
  if type(ok) == 'table' and ok.err then return {3, c, ok.err} end
  a = a + n + 1
end
for i = 1, nk do
  local r = recs[i]
  local ret = tonumber(ARGV[2 + 2 * i])
  local nv = 'i1|1|' .. r.body .. r.lus .. '|' .. r.atts .. '|' .. r.fs .. '|' ..
    nows .. '|' .. fmt(now + ret) .. '|-'
  redis.call('SET', KEYS[i], nv, 'PX', ret + grace)
end
return {1}
"#;

/// `KEYS[1]`; `ARGV` = unused, token, in-progress grace ms, `1` when the handler did not
/// run (the claim's attempt is taken back). Reply 1 released, 0 fenced (not the token's,
/// completed, or already released), 9 unreadable.
const RELEASE_BODY: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then return 9 end
if not v then return 0 end
local r = parse(v)
if not r then return 9 end
if r.tok ~= ARGV[2] or r.st ~= '0' or r.lu == 0 then return 0 end
local atts = r.atts
local n = tonumber(atts)
if ARGV[4] == '1' and n and n > 0 then atts = string.format('%d', n - 1) end
local nv = 'i1|0|' .. r.body .. '0|' .. atts .. '|' .. r.fs .. '|' .. r.cm .. '|' .. r.ex ..
  '|' .. r.tail
redis.call('SET', KEYS[1], nv, 'PX', tonumber(ARGV[3]))
return 1
"#;

/// `KEYS[1]`; `ARGV` = unused, token, retention ms, completed grace ms. Records the key
/// rolled back while the token holds it. Reply 1 rolled back (now, or before by this token:
/// a retry whose reply was lost), 0 fenced (not the token's, released, completed), 9
/// unreadable.
const ROLL_BACK_BODY: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then return 9 end
if not v then return 0 end
local r = parse(v)
if not r then return 9 end
if r.tok ~= ARGV[2] then return 0 end
if r.st == '2' then return 1 end
if r.st ~= '0' or r.lu == 0 then return 0 end
local ret = tonumber(ARGV[3])
local nv = 'i1|2|' .. r.body .. r.lus .. '|' .. r.atts .. '|' .. r.fs .. '|' ..
  fmt(now) .. '|' .. fmt(now + ret) .. '|-'
redis.call('SET', KEYS[1], nv, 'PX', ret + tonumber(ARGV[4]))
return 1
"#;

/// `KEYS[1]`; `ARGV` = unused, token, lease ms, in-progress grace ms. Reply: new lease end
/// (server time),
/// 0 fenced (not the token's, completed, or released), -1 unreadable. An ended lease not
/// taken over still belongs to its token and can be extended.
const EXTEND_BODY: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then return -1 end
if not v then return 0 end
local r = parse(v)
if not r then return -1 end
if r.tok ~= ARGV[2] or r.st ~= '0' or r.lu == 0 then return 0 end
local lease = tonumber(ARGV[3])
local lu = now + lease
local nv = 'i1|0|' .. r.body .. fmt(lu) .. '|' .. r.atts .. '|' .. r.fs .. '|' .. r.cm ..
  '|' .. r.ex .. '|' .. r.tail
redis.call('SET', KEYS[1], nv, 'PX', lease + tonumber(ARGV[4]))
return lu
"#;

/// `KEYS` = candidate keys from a SCAN; `ARGV` = unused, how many may still be deleted.
/// Deletes completed and rolled-back records whose retention ended; replies with the count.
const PURGE_BODY: &str = r#"
local lim = tonumber(ARGV[2])
local n = 0
for i = 1, #KEYS do
  if n >= lim then break end
  local v = redis.pcall('GET', KEYS[i])
  if type(v) == 'string' then
    local r = parse(v)
    if r and r.st ~= '0' and r.ex ~= '' and tonumber(r.ex) <= now then
      redis.call('DEL', KEYS[i])
      n = n + 1
    end
  end
end
return n
"#;

/// A script: its source and SHA1, for `EVALSHA` with a `SCRIPT LOAD` after `NOSCRIPT`.
pub(crate) struct Lua {
    pub(crate) name: &'static str,
    pub(crate) sha: String,
    pub(crate) src: String,
}

fn lua(name: &'static str, body: &str) -> Lua {
    let src = format!("{PRELUDE}{body}");
    let sha = redis::Script::new(&src).get_hash().to_string();
    Lua { name, sha, src }
}

pub(crate) static CLAIM: LazyLock<Lua> = LazyLock::new(|| lua("claim", CLAIM_BODY));
pub(crate) static COMPLETE: LazyLock<Lua> = LazyLock::new(|| lua("complete", COMPLETE_BODY));
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| lua("release", RELEASE_BODY));
pub(crate) static EXTEND: LazyLock<Lua> = LazyLock::new(|| lua("extend", EXTEND_BODY));
pub(crate) static ROLL_BACK: LazyLock<Lua> = LazyLock::new(|| lua("roll_back", ROLL_BACK_BODY));
pub(crate) static PURGE: LazyLock<Lua> = LazyLock::new(|| lua("purge", PURGE_BODY));
pub(crate) static COMPLETE_WITH: LazyLock<Lua> =
    LazyLock::new(|| lua("complete_with", COMPLETE_WITH_BODY));

pub(crate) static COMPLETE_BATCH_WITH: LazyLock<Lua> =
    LazyLock::new(|| lua("complete_batch_with", COMPLETE_BATCH_WITH_BODY));

/// Every script, for loading them up front.
pub(crate) fn all() -> [&'static Lua; 8] {
    [
        &CLAIM,
        &COMPLETE,
        &RELEASE,
        &EXTEND,
        &ROLL_BACK,
        &PURGE,
        &COMPLETE_WITH,
        &COMPLETE_BATCH_WITH,
    ]
}
