"""The worker's server-side Lua scripts, and how they are called.

Why Lua and not MULTI/EXEC: a transaction cannot look before it writes. The settle
script first checks, inside the same atomic step, that the consumer group exists and
which entries are still pending on this consumer, and only then writes results and
acks. So a worker never acks or writes for entries another worker reclaimed, and a
lost group (NOGROUP) aborts the write before anything is written. Redis runs a script
atomically like MULTI/EXEC (nothing interleaves; AOF and replicas get its effects as
one transaction).

Called with EVALSHA, falling back to EVAL when the server does not know the script
(after a restart): the worker's ACL user needs ``+evalsha +eval``. The reads of the
input stream are scripts too (``read_scripts.py``: every entry measured before it is sent).
"""

from __future__ import annotations

import hashlib
import re

import redis

# Exact comparison / successor of stream ids ("<ms>-<seq>", 64-bit decimals) without Lua doubles.
_ID_HELPERS = r"""
local function split(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms, seq
end
local function num_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function id_less(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  if am ~= bm then return num_less(am, bm) end
  return num_less(as, bs)
end
local function incr(s)
  local digits, i = {}, #s
  for c in string.gmatch(s, '%d') do digits[#digits + 1] = c end
  while i >= 1 do
    if digits[i] ~= '9' then
      digits[i] = string.char(string.byte(digits[i]) + 1)
      return table.concat(digits)
    end
    digits[i] = '0'
    i = i - 1
  end
  return '1' .. table.concat(digits)
end
local function id_succ(id)
  local ms, seq = split(id)
  if seq == '18446744073709551615' then return incr(ms) .. '-0' end
  return ms .. '-' .. incr(seq)
end
local function field(flat, name)
  for j = 1, #flat, 2 do
    if flat[j] == name then return flat[j + 1] end
  end
  return nil
end
-- the smallest id the group may still need: its oldest pending entry, else the one after the last delivered
local function needed_from(stream, group, last_delivered)
  local p = redis.call('XPENDING', stream, group)
  if tonumber(p[1]) > 0 then return p[2] end
  return id_succ(last_delivered)
end
"""

SETTLE = (
    _ID_HELPERS
    + r"""
-- KEYS[1] input stream, KEYS[2] results stream, KEYS[3] dead-letter stream, KEYS[4] recovery-point key,
-- KEYS[5..] the latest-result key of each record that has one, in record order.
-- ARGV[1] group, ARGV[2] consumer ('' = no ownership check), ARGV[3] results maxlen, ARGV[4] dead-letter maxlen,
-- ARGV[5] result key ttl s, ARGV[6] trim the input stream: '0' no, '1' yes, or an id: yes, never at or above it
-- (the lowest entry this process holds), ARGV[7] number of ack ids, the ack ids,
-- then the number of field layouts and each layout (its field count, its field names), then per record: kind
-- ('r' result | 'd' dead letter), stream id, has key (1/0), the record as one JSON object of strings (with a key:
-- that key's value), its layout's number. Its stream entry gets the layout's fields, in the layout's order.
-- Returns {records written, entries acked, error or '', n, the n ids lost from the group (below), ids skipped
-- (not pending on this consumer)...}. A failed record write (error) acks nothing: the entries stay pending and
-- the caller retries. An entry lost from the group (pending on no consumer, still in the stream, its record not
-- written by anyone: the group was destroyed and created again at '$', or someone XACKed it) gets its record,
-- with nothing to ack (skipped as not ours, its classified ticket had no record at all).
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
for k = 2, 3 do  -- a key of another type would fail half-way: refuse before writing anything
  local t = redis.call('TYPE', KEYS[k])['ok']
  if t ~= 'stream' and t ~= 'none' then
    return redis.error_reply('WRONGTYPE ' .. KEYS[k] .. ' holds a ' .. t .. ', not a stream')
  end
end
local n_ids = tonumber(ARGV[7])
local i = 8 + n_ids
local acks, skipped, gone, mine = {}, {}, {}, {}
if consumer ~= '' and n_ids > 0 then
  -- this consumer's pending entries between the lowest and highest id, page by page (one range scan, not
  -- one lookup per id). NOGROUP (group destroyed, Redis restarted empty) raises here, before any write.
  local lo, hi = ARGV[8], ARGV[8]
  for k = 8, 7 + n_ids do
    if id_less(ARGV[k], lo) then lo = ARGV[k] end
    if id_less(hi, ARGV[k]) then hi = ARGV[k] end
  end
  local start = lo
  while true do
    local page = redis.call('XPENDING', stream, group, start, hi, 1000, consumer)
    for _, row in ipairs(page) do mine[row[1]] = true end
    if #page < 1000 then break end
    start = '(' .. page[#page][1]
  end
end
for k = 8, 7 + n_ids do
  local id = ARGV[k]
  if consumer == '' or mine[id] then
    acks[#acks + 1] = id
  else
    gone[id] = true  -- not ours: skipped, unless lost from the group (lost_from_group, per record)
  end
end
-- the latest-result key answers the entry with the highest stream id: an older entry's record (a later pass
-- of the same window, a reclaimed duplicate, a slow worker) never replaces a newer one's
local function holds_later(key, sid)
  if not split(sid) then return false end
  local cur = redis.pcall('GET', key)
  if type(cur) ~= 'string' then return false end
  local cur_sid = string.match(cur, '"stream_id": "(%d+%-%d+)"')
  return cur_sid ~= nil and id_less(sid, cur_sid)
end
-- at or below the group's last delivered id (above it, as after a recreation at the recovery point, it is
-- delivered again), pending on no consumer, still in the stream (a deleted one is its claimer's: an orphan dead
-- letter), and its key holds no record of this entry or a later one (another worker's, or an earlier try of this
-- write)
local last_delivered = nil
local function lost_from_group(sid, key)
  if not key then return false end
  if last_delivered == nil then
    last_delivered = '0-0'
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      if field(g, 'name') == group then last_delivered = field(g, 'last-delivered-id') end
    end
  end
  if id_less(last_delivered, sid) or #redis.call('XPENDING', stream, group, sid, sid, 1) > 0 then return false end
  if #redis.call('XRANGE', stream, sid, sid) == 0 then return false end
  local cur = redis.pcall('GET', key)
  local cur_sid = type(cur) == 'string' and string.match(cur, '"stream_id": "(%d+%-%d+)"') or nil
  return cur_sid == nil or id_less(cur_sid, sid)
end
local lost = {}
local kidx, written, err = 5, 0, ''
local function try(cmd, key, ...)  -- the first refusal, with the command and key it hit (NOPERM names neither)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r['err'] and err == '' then err = cmd .. ' ' .. key .. '\t' .. r['err'] end
end
local layouts = {}
for l = 1, tonumber(ARGV[i]) do
  local nf = tonumber(ARGV[i + 1])
  layouts[l] = {unpack(ARGV, i + 2, i + 1 + nf)}
  i = i + 1 + nf
end
i = i + 1
while i <= #ARGV do
  local kind, sid, has_key, value = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local rec, fields = cjson.decode(value), {}
  for f, name in ipairs(layouts[tonumber(ARGV[i + 4])]) do
    fields[2 * f - 1], fields[2 * f] = name, rec[name]
  end
  i = i + 5
  local key = nil
  if has_key == '1' then
    key = KEYS[kidx]
    kidx = kidx + 1
  end
  if gone[sid] and lost[sid] == nil then lost[sid] = lost_from_group(sid, key) end
  if not gone[sid] or lost[sid] then
    local target, maxlen = KEYS[2], ARGV[3]
    if kind == 'd' then target, maxlen = KEYS[3], ARGV[4] end
    try('XADD', target, 'MAXLEN', '~', maxlen, '*', unpack(fields))
    if key and not holds_later(key, sid) then try('SET', key, value, 'EX', ARGV[5]) end
    written = written + 1
  end
  if err ~= '' then break end  -- the rest would only be written again by the retry
end
local lost_ids = {}
for k = 8, 7 + n_ids do
  local id = ARGV[k]
  if lost[id] then lost_ids[#lost_ids + 1] = id elseif gone[id] then skipped[#skipped + 1] = id end
end
local out = {written, 0, err, #lost_ids}
for _, id in ipairs(lost_ids) do out[#out + 1] = id end
for _, id in ipairs(skipped) do out[#out + 1] = id end
if err ~= '' then return out end  -- a record failed (e.g. OOM): ack nothing, the caller retries
for s = 1, #acks, 1000 do
  local r = redis.pcall('XACK', stream, group, unpack(acks, s, math.min(s + 999, #acks)))
  if type(r) == 'table' and r['err'] then  -- refused (an ACL without XACK): the records stand, nothing acked
    out[3] = 'XACK ' .. stream .. '\t' .. r['err']
    return out
  end
end
out[2] = #acks
if consumer ~= '' then
  -- recovery point: every entry below it is settled for this group; trim: below the lowest over all groups.
  -- Best effort (pcall): a stale recovery point only means more replay after a lost group.
  pcall(function()
    local floor, ours = nil, nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local name = field(g, 'name')
      local need = needed_from(stream, name, field(g, 'last-delivered-id'))
      if name == group then ours = need end
      if floor == nil or id_less(need, floor) then floor = need end
    end
    if ours then redis.call('SET', KEYS[4], ours) end
    if ARGV[6] ~= '1' and ARGV[6] ~= '0' and floor and id_less(ARGV[6], floor) then floor = ARGV[6] end
    if ARGV[6] ~= '0' and floor then redis.call('XTRIM', stream, 'MINID', '~', floor) end
  end)
end
return out
"""
)


REFRESH = (
    _ID_HELPERS
    + r"""
-- Reset the idle time of the entries this consumer still holds, so no other worker reclaims them
-- while it is alive: XCLAIM <min-idle 0> ... JUSTID by the owner (JUSTID: the delivery count stays).
-- Atomic with the ownership check, so an entry another worker claimed in the meantime is never
-- taken back; entries deleted from the stream are left alone (XCLAIM would drop them from the PEL).
-- KEYS[1] input stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] the ids it holds. Returns how many.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
if #ARGV < 3 then return 0 end
local lo, hi = ARGV[3], ARGV[3]
for k = 3, #ARGV do
  if id_less(ARGV[k], lo) then lo = ARGV[k] end
  if id_less(hi, ARGV[k]) then hi = ARGV[k] end
end
local mine, start = {}, lo
while true do
  local page = redis.call('XPENDING', stream, group, start, hi, 1000, consumer)  -- NOGROUP raises here
  for _, row in ipairs(page) do mine[row[1]] = true end
  if #page < 1000 then break end
  start = '(' .. page[#page][1]
end
local ids = {}
for k = 3, #ARGV do
  local id = ARGV[k]
  if mine[id] and #redis.call('XRANGE', stream, id, id) > 0 then ids[#ids + 1] = id end
end
for s = 1, #ids, 1000 do
  local args = {stream, group, consumer, 0}
  for k = s, math.min(s + 999, #ids) do args[#args + 1] = ids[k] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return #ids
"""
)


HEARTBEAT = r"""
-- Write a heartbeat only where the consumer name is still this process's own. A keeper frozen past its TTL (SIGSTOP,
-- a long Redis outage) must not overwrite the beat of the process that took the name over meanwhile, and a claim
-- takes over a dead holder's key only if it still holds the value it saw (a holder that beat at the last moment is
-- alive). KEYS[1] heartbeat key; ARGV[1] this process's instance id, ARGV[2] the value, ARGV[3] TTL s, ARGV[4] the
-- one value it may replace ('' = none). The key is written when missing, this instance's, exactly ARGV[4], or no
-- worker's heartbeat (another type, not JSON, no pid). Returns {'written', the value replaced ('' for another type)
-- or false when the key was missing or its own} or {'held', the other process's heartbeat} (nothing written).
local key, me = KEYS[1], ARGV[1]
local kind = redis.call('TYPE', key)['ok']
local replaced = false
if kind == 'string' then
  local cur = redis.call('GET', key)
  local ok, v = pcall(cjson.decode, cur)
  local pid = ok and type(v) == 'table' and v['pid']
  local worker = (type(pid) == 'number' and pid ~= 0) or (type(pid) == 'string' and pid ~= '')
  if worker and v['instance'] == me then
    replaced = false
  elseif worker and cur ~= ARGV[4] then
    return {'held', cur}
  else
    replaced = cur
  end
elseif kind ~= 'none' then
  replaced = ''
end
redis.call('SET', key, ARGV[2], 'EX', ARGV[3])
return {'written', replaced}
"""

RELEASE = r"""
-- Delete a heartbeat at exit only if it is still this process's (ARGV[1] its instance id): a process that took the
-- name over keeps its key. KEYS[1] heartbeat key. Returns 1 if deleted, else 0.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then return 0 end
local ok, v = pcall(cjson.decode, redis.call('GET', KEYS[1]))
if ok and type(v) == 'table' and v['instance'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

LEAVE = r"""
-- Remove this process's consumer from the group at exit, in one step: only while the name is still this process's
-- (its heartbeat, or none: expired, Redis restarted empty) and the consumer has nothing pending. As three commands
-- (GET, XPENDING, XGROUP DELCONSUMER) a process that took the name over in between could lose the entries it had
-- just read: DELCONSUMER drops a consumer's pending entries with it. KEYS[1] heartbeat key, KEYS[2] input stream;
-- ARGV[1] this process's instance id, ARGV[2] group, ARGV[3] consumer. Returns 1 if removed, else 0.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'string' then
  local ok, v = pcall(cjson.decode, redis.call('GET', KEYS[1]))
  if not (ok and type(v) == 'table' and v['instance'] == ARGV[1]) then return 0 end
elseif kind ~= 'none' then
  return 0
end
if redis.call('TYPE', KEYS[2])['ok'] ~= 'stream' then return 0 end
if #redis.call('XPENDING', KEYS[2], ARGV[2], '-', '+', 1, ARGV[3]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


class Script:
    """A Lua script run with EVALSHA (EVAL once the server has forgotten it, e.g. after a restart).

    Not redis-py's ``register_script``: its fallback is SCRIPT LOAD, which the least-privilege ACL
    (docs/reliability.md, ``+evalsha +eval``) refuses with NOPERM once a restart emptied the script cache."""

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: list, args: list):
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


# Redis 6.2 wraps an error raised inside a script: a command's own error as "...: @user_script:13: NOGROUP ...", a
# call Redis refuses before it runs (a write on a read-only replica, MISCONF) as "...: @user_script:43: @user_script:
# 43: -READONLY ..."; 7.0+ and Valkey pass it on as it is.
_WRAPPED = re.compile(r"Error running script \(call to [^)]*\): @[\w-]+:\d+: (?:@[\w-]+: \d+: -)?(?=[A-Z]+\b)")


def error_message(e: BaseException) -> str:
    """A Redis error's message as the server's own command words it (``READONLY You can't write ...``), a script's
    included, on any server version: redis-py then maps 6.2's wrapped form to no error class of its own."""
    msg = str(e)
    m = _WRAPPED.match(msg)
    return msg[m.end() :] if m else msg


def error_code(e: BaseException) -> str:
    """The error code (NOGROUP, WRONGTYPE, ...) of a Redis error, a script's included, on any server version."""
    return error_message(e).split(" ", 1)[0]


settle_script = Script(SETTLE)
refresh_script = Script(REFRESH)
heartbeat_script = Script(HEARTBEAT)
release_script = Script(RELEASE)
leave_script = Script(LEAVE)
