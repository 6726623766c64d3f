--[[
What Stagehand's Slurm scripts share: the settings of stagehand-slurm.conf, the #BB_LUA directives
of a job, who may stage which project, and how the stagehand CLI is run without a secret on its
command line. burst_buffer.lua (burst_buffer/lua) and job_submit.lua (job_submit/lua) load it with
dofile from the folder they live in, the one holding slurm.conf; each runs it in its own Lua state.

Who may stage what. A directive's project (project=, or STAGEHAND_PROJECT) must be allowed to the
job by an `allow` line of stagehand-slurm.conf; nothing is allowed by default:

  allow account=<Slurm account> <project>[,<project>...]
  allow user=<user name> ...   allow uid=<uid> ...   allow gid=<gid> ...

account is the job's Slurm account (sbatch -A, or the user's default account); it means something
only when slurmdbd enforces associations (AccountingStorageEnforce=associations), since without
accounting any user may name any account. user/uid are the submitting user, gid the job's group
(the user's primary group unless root submits with --gid). Groups are numbers: Slurm hands the
scripts the job's gid, and resolving a group name inside slurmctld could block it.
--]]

local M = {}

--- Settings -----------------------------------------------------------------------------------

M.defaults = {
	STAGEHAND_BIN = "stagehand",
	STAGEHAND_NATS_URL = "nats://127.0.0.1:4222",
	STAGEHAND_NATS_CREDS = "",
	STAGEHAND_NATS_NKEY = "",
	STAGEHAND_NATS_PASSWORD_FILE = "",
	STAGEHAND_NATS_TLS_CA = "",
	STAGEHAND_PROJECT = "",
	STAGEHAND_JOB_PREFIX = "slurm-",
	STAGEHAND_STATE_DIR = "/run/stagehand-slurm",
	STAGEHAND_CONNECT_TIMEOUT = "10",
	STAGEHAND_STAGE_TIMEOUT = "3600",
	STAGEHAND_STATUS_EVERY = "30",
	STAGEHAND_HOT_TIER = "hot",
	STAGEHAND_LOCAL_TIERS = "local",
	STAGEHAND_HOLD_SLACK = "86400",
	STAGEHAND_POOL_TIERS = "",
	STAGEHAND_POOL_FILE = "/run/stagehand-slurm/pools",
	STAGEHAND_POOL_MAX_AGE = "300",
}

local function valid_token(s)
	return #s >= 1 and #s <= 64 and s:match("^[a-z0-9_-]+$") ~= nil
end

local WHO_KEYS = { account = true, user = true, uid = true, gid = true }

-- One `allow` line: { key, value, projects = { [p] = true } }, or nil and what is wrong.
local function parse_allow(rest)
	local who, list = rest:match("^(%S+)%s+(%S+)%s*$")
	if not who then
		return nil, "expected 'allow <account|user|uid|gid>=<value> <project>[,<project>...]'"
	end
	local key, value = who:match("^([a-z]+)=(.+)$")
	if not key or not WHO_KEYS[key] then
		return nil, "'" .. who .. "' is not account=, user=, uid= or gid="
	end
	if (key == "uid" or key == "gid") and not value:match("^%d+$") then
		return nil, key .. " '" .. value .. "' is not a number"
	end
	local projects = {}
	for p in list:gmatch("[^,]+") do
		if not valid_token(p) then
			return nil, "project '" .. p .. "' must be 1-64 characters of [a-z0-9_-]"
		end
		projects[p] = true
	end
	return { key = key, value = value, projects = projects }
end

-- Reads KEY=VALUE lines and `allow` lines of `dir`/stagehand-slurm.conf over the defaults.
-- Read at every call: an edit takes effect without restarting slurmctld. A bad `allow` line
-- is kept as conf.allow_error, and then every project is refused with it (never allowed).
function M.load_settings(dir)
	local conf = { allow = {} }
	for k, v in pairs(M.defaults) do
		conf[k] = v
	end
	local path = dir .. "/stagehand-slurm.conf"
	conf.path = path
	local f = io.open(path, "r")
	if f then
		local lineno = 0
		for line in f:lines() do
			lineno = lineno + 1
			local k, v = line:match("^%s*([A-Z_][A-Z0-9_]*)=(.-)%s*$")
			local rest = line:match("^%s*allow%s+(.-)%s*$")
			if k then
				conf[k] = v
			elseif rest then
				local rule, err = parse_allow(rest)
				if rule then
					conf.allow[#conf.allow + 1] = rule
				elseif not conf.allow_error then
					conf.allow_error = path .. " line " .. lineno .. " (" .. line .. "): " .. err
				end
			end
		end
		f:close()
	end
	return conf
end

function M.is_local_tier(conf, tier)
	for t in conf.STAGEHAND_LOCAL_TIERS:gmatch("[^%s,]+") do
		if t == tier then
			return true
		end
	end
	return false
end

--- Directives -----------------------------------------------------------------------------------

local KEYS = {
	dataset = true, version = true, tier = true, project = true, name = true, form = true, deadline = true, hold = true,
	capacity = true, pool = true,
}

-- Whether `tier` is one the hooks report to Slurm as a pool (STAGEHAND_POOL_TIERS).
function M.is_pool_tier(conf, tier)
	for t in conf.STAGEHAND_POOL_TIERS:gmatch("[^%s,]+") do
		if t == tier then
			return true
		end
	end
	return false
end

-- The units Slurm takes after a burst buffer's capacity= (suffix_mult of Slurm's
-- src/common/slurm_protocol_defs.c, case-insensitive): k and kib are 1024, kb is 1000, and so on.
local UNITS = { [""] = 1, k = 2 ^ 10, kib = 2 ^ 10, kb = 1e3, m = 2 ^ 20, mib = 2 ^ 20, mb = 1e6,
	g = 2 ^ 30, gib = 2 ^ 30, gb = 1e9, t = 2 ^ 40, tib = 2 ^ 40, tb = 1e12 }

-- The bytes of a capacity= value as Slurm counts them, or nil for one Slurm would read
-- otherwise (zero, no number, a unit it ignores).
function M.capacity_bytes(s)
	local number, unit = s:match("^(%d+)(%a*)$")
	local mult = unit and UNITS[unit:lower()]
	if not number or not mult or tonumber(number) == 0 then
		return nil
	end
	return tonumber(number) * mult
end

local function valid_dataset(s)
	return #s >= 1 and #s <= 128 and s:sub(1, 1) ~= "." and s:match("^[A-Za-z0-9._-]+$") ~= nil
end

local function valid_version(s)
	return #s >= 12 and #s <= 64 and s:match("^[0-9a-f]+$") ~= nil
end

-- A duration as `stagehand` flags take it (services/config/README.md): a whole number and one
-- of ms, s, m, h, d, w, or a bare number of seconds.
local function valid_duration(s)
	return s:match("^[0-9]+[smhdw]?$") ~= nil or s:match("^[0-9]+ms$") ~= nil
end

-- The pool of `project`'s share of pool tier `tier` (its quota there): `<tier>.<project>`.
function M.project_pool(tier, project)
	return tier .. "." .. project
end

-- What is wrong with a directive's capacity= and pool=, or nil. Slurm reads them itself (the
-- job's size in a pool, summed over the job's lines, in the pool of its last such line), so a
-- directive on a tier reported as a pool must declare its size in that pool, and a job draws
-- on one pool only. The pool is the tier's, or its project's share of it (`<tier>.<project>`,
-- which also holds the job until its data fits the project's quota); never another project's.
-- `pool` is the first pool of the job's earlier directives.
local function capacity_problem(conf, d, pool)
	local shared = d.local_tier and conf.STAGEHAND_HOT_TIER or d.tier
	local own = M.project_pool(shared, d.project)
	if d.capacity == nil then
		if d.pool then
			return "pool= needs capacity= (the bytes of the version)"
		end
		if M.is_pool_tier(conf, shared) then
			return "tier " .. shared .. " is a Slurm pool (STAGEHAND_POOL_TIERS): add capacity=<bytes of "
				.. d.dataset .. "@" .. d.version .. "> pool=" .. own
		end
		return nil
	end
	d.capacity_bytes = M.capacity_bytes(d.capacity)
	if not d.capacity_bytes then
		return "capacity '" .. d.capacity .. "' must be a number of bytes above 0, with an optional unit (K, KiB, KB, M, MiB, MB, G, GiB, GB, T, TiB, TB)"
	elseif d.pool ~= shared and d.pool ~= own then
		return "capacity= needs pool=" .. own .. " (the project's share of the tier the version is staged to) or pool="
			.. shared .. " (the whole tier)"
	elseif not M.is_pool_tier(conf, shared) then
		return "tier " .. shared .. " is not a Slurm pool (STAGEHAND_POOL_TIERS): drop capacity= and pool="
	elseif pool and pool ~= d.pool then
		return "pool " .. d.pool .. " differs from the job's pool " .. pool .. " (Slurm counts a job in one pool)"
	end
	return nil
end

function M.default_name(dataset)
	return (dataset:upper():gsub("[^A-Z0-9]", "_"))
end

-- The lines of `text`, for directive parsing of a script held as a string.
local function lines_of(text)
	local lines = {}
	for line in (text .. "\n"):gmatch("([^\n]*)\n") do
		lines[#lines + 1] = (line:gsub("\r$", ""))
	end
	return lines
end
M.lines_of = lines_of

-- The directives of a job script given as its lines: a list of { line, dataset, version, tier,
-- project, name, form, deadline, hold, local_tier }, or nil and a message naming the line and
-- what is wrong. With `leading_only`, only the leading comment block counts (a batch script,
-- like #SBATCH lines); without, every line is a directive (--bb options).
function M.parse_lines(conf, lines, leading_only)
	local directives, names, pool = {}, {}, nil
	for lineno, line in ipairs(lines) do
		if leading_only and not (line:match("^%s*$") or line:match("^#")) then
			break
		end
		local rest = line:match("^#BB_LUA%s*(.*)$")
		if rest then
			local where = "line " .. lineno .. " (" .. line .. ")"
			local words = {}
			for w in rest:gmatch("%S+") do
				words[#words + 1] = w
			end
			if words[1] ~= "stage" then
				return nil, where .. ": a #BB_LUA line must start with 'stage'"
			end
			local d = { line = lineno, text = line }
			for i = 2, #words do
				local k, v = words[i]:match("^([a-z]+)=(.*)$")
				if not k then
					return nil, where .. ": '" .. words[i] .. "' is not key=value"
				end
				if not KEYS[k] then
					return nil, where .. ": unknown key '" .. k
						.. "' (known: dataset, version, tier, project, name, form, deadline, hold, capacity, pool)"
				end
				if d[k] then
					return nil, where .. ": '" .. k .. "' given twice"
				end
				d[k] = v
			end
			local problem
			d.project = d.project or (conf.STAGEHAND_PROJECT ~= "" and conf.STAGEHAND_PROJECT or nil)
			if not d.dataset then
				problem = "dataset= is missing"
			elseif not valid_dataset(d.dataset) then
				problem = "dataset '" .. d.dataset .. "' must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
			elseif not d.version then
				problem = "version= is missing"
			elseif not valid_version(d.version) then
				problem = "version '" .. d.version .. "' must be a digest or a prefix of at least 12 lowercase hex characters"
			elseif not d.tier then
				problem = "tier= is missing"
			elseif not valid_token(d.tier) then
				problem = "tier '" .. d.tier .. "' must be 1-64 characters of [a-z0-9_-]"
			elseif not d.project then
				problem = "project= is missing and stagehand-slurm.conf sets no STAGEHAND_PROJECT"
			elseif not valid_token(d.project) then
				problem = "project '" .. d.project .. "' must be 1-64 characters of [a-z0-9_-]"
			elseif d.form and d.form ~= "raw" and d.form ~= "prepared" then
				problem = "form '" .. d.form .. "' must be raw or prepared"
			elseif d.deadline and not valid_duration(d.deadline) then
				problem = "deadline '" .. d.deadline .. "' must be a duration such as 90s, 30m, 2h, 1d or 2w"
			elseif d.hold and not valid_duration(d.hold) then
				problem = "hold '" .. d.hold .. "' must be a duration such as 90s, 30m, 2h, 1d or 2w"
			elseif d.name and not d.name:match("^[A-Za-z0-9_]+$") then
				problem = "name '" .. d.name .. "' must be letters, digits and '_'"
			end
			if problem then
				return nil, where .. ": " .. problem
			end
			d.name = d.name or M.default_name(d.dataset)
			if names[d.name] then
				return nil, where .. ": STAGEHAND_DATA_" .. d.name .. " is already named by line " .. names[d.name]
					.. " (give one of them name=...)"
			end
			names[d.name] = lineno
			d.local_tier = M.is_local_tier(conf, d.tier)
			problem = capacity_problem(conf, d, pool)
			if problem then
				return nil, where .. ": " .. problem
			end
			pool = pool or d.pool
			directives[#directives + 1] = d
		end
	end
	return directives
end

-- The directives of the job script at `path` (its leading comment block).
function M.parse_file(conf, path)
	local f, err = io.open(path, "r")
	if not f then
		return nil, "cannot read the job script: " .. tostring(err)
	end
	local text = f:read("*a")
	f:close()
	return M.parse_lines(conf, lines_of(text), true)
end

--- Pools ----------------------------------------------------------------------------------------

-- What slurm_bb_pools reports for a tier whose figures are unknown: a pool Slurm never finds too
-- small (a PiB), so jobs are staged as they were before pools, limited only by what Slurm counts
-- itself (the capacity= of the jobs it is staging and running) and by Stagehand's own quotas.
M.UNBOUNDED_POOL = 2 ^ 50

-- The figures `stagehand tier pool --slurm FILE` wrote: { written = unix seconds, pools = {
-- [tier] = { capacity, free, default_quota, quotas = { [project] = { quota, reserved } } } } },
-- or nil and why not. The file holds lines `written <secs>`, `pool <tier> <capacity bytes>
-- <free bytes>`, and after a tier's pool line its quotas: `quota-default <tier> <bytes>` and
-- `quota <tier> <project> <quota bytes> <reserved bytes>`; anything else is a comment.
function M.read_pool_file(path)
	local f, err = io.open(path, "r")
	if not f then
		return nil, tostring(err)
	end
	local figures = { pools = {} }
	for line in f:lines() do
		local written = line:match("^written (%d+)%s*$")
		local tier, capacity, free = line:match("^pool (%S+) (%d+) (%d+)%s*$")
		local default_of, default = line:match("^quota%-default (%S+) (%d+)%s*$")
		local quota_of, project, quota, reserved = line:match("^quota (%S+) (%S+) (%d+) (%d+)%s*$")
		if written then
			figures.written = tonumber(written)
		elseif tier then
			figures.pools[tier] = { capacity = tonumber(capacity), free = tonumber(free), quotas = {} }
		elseif default_of and figures.pools[default_of] then
			figures.pools[default_of].default_quota = tonumber(default)
		elseif quota_of and figures.pools[quota_of] then
			figures.pools[quota_of].quotas[project] = { quota = tonumber(quota), reserved = tonumber(reserved) }
		end
	end
	f:close()
	if not figures.written then
		return nil, path .. " has no 'written' line"
	end
	return figures
end

-- slurm_bb_pools' answer (burst_buffer/lua's format: a JSON object whose `pools` list holds
-- { id, quantity, granularity, free }) for the tiers of STAGEHAND_POOL_TIERS, from the pool file
-- when it is at most STAGEHAND_POOL_MAX_AGE seconds old; a tier without fresh figures is
-- reported unbounded ([M.UNBOUNDED_POOL]). Returns the JSON (nil when no tier is a pool) and a
-- line saying which tiers are unbounded and why (nil when none is). Reads one small file: it
-- runs inside slurmctld, which it must never hold up.
function M.slurm_pools(conf, now)
	local tiers = {}
	for t in conf.STAGEHAND_POOL_TIERS:gmatch("[^%s,]+") do
		if valid_token(t) then
			tiers[#tiers + 1] = t
		end
	end
	if #tiers == 0 then
		return nil, nil
	end
	local figures, why = M.read_pool_file(conf.STAGEHAND_POOL_FILE)
	local max_age = tonumber(conf.STAGEHAND_POOL_MAX_AGE) or 300
	if figures and now - figures.written > max_age then
		why = conf.STAGEHAND_POOL_FILE .. " was written " .. (now - figures.written)
			.. " s ago, more than STAGEHAND_POOL_MAX_AGE (" .. max_age .. " s)"
		figures = nil
	end
	local items, unbounded = {}, {}
	local function report(id, quantity, free)
		items[#items + 1] = string.format('{"id":"%s","quantity":%.0f,"granularity":1,"free":%.0f}',
			id, quantity, math.max(0, math.min(free, quantity)))
	end
	local projects = M.allowed_projects(conf)
	for _, t in ipairs(tiers) do
		local p = figures and figures.pools[t]
		if not p then
			unbounded[#unbounded + 1] = t
			p = { capacity = M.UNBOUNDED_POOL, free = M.UNBOUNDED_POOL, quotas = {} }
		end
		report(t, p.capacity, p.free)
		-- Each project's share: its quota less what it holds there, and never more than the
		-- tier has free (a project without a quota shares the tier's figures).
		for _, project in ipairs(projects) do
			local q = p.quotas[project]
			local quota = q and q.quota or p.default_quota
			if quota then
				report(M.project_pool(t, project), quota, math.min(p.free, quota - (q and q.reserved or 0)))
			else
				report(M.project_pool(t, project), p.capacity, p.free)
			end
		end
	end
	local note
	if #unbounded > 0 then
		note = "pools " .. table.concat(unbounded, ", ") .. " reported unbounded: "
			.. (why or ("no figures for them in " .. conf.STAGEHAND_POOL_FILE))
	end
	return '{"pools":[' .. table.concat(items, ",") .. "]}", note
end

--- Who may stage what -------------------------------------------------------------------------

-- `who`: { user = name or nil, uid = number or nil, gid = number or nil, account = name or nil }.
local function matches(rule, who)
	local v = who[rule.key]
	return v ~= nil and tostring(v) == rule.value
end

-- The projects the `allow` rules for which `applies(rule)` holds name, as a sorted list.
local function projects_where(conf, applies)
	local set, list = {}, {}
	for _, rule in ipairs(conf.allow) do
		if applies(rule) then
			for p in pairs(rule.projects) do
				if not set[p] then
					set[p] = true
					list[#list + 1] = p
				end
			end
		end
	end
	table.sort(list)
	return list
end

-- Every project some `allow` rule names, as a sorted list: the projects whose share of each
-- pool tier slurm_bb_pools reports.
function M.allowed_projects(conf)
	return projects_where(conf, function()
		return true
	end)
end

-- The projects the rules allow `who`, as a sorted list.
function M.projects_of(conf, who)
	return projects_where(conf, function(rule)
		return matches(rule, who)
	end)
end

function M.describe_who(who)
	local parts = {}
	if who.user then
		parts[#parts + 1] = "user " .. who.user
	end
	if who.uid then
		parts[#parts + 1] = "uid " .. tostring(who.uid)
	end
	if who.gid then
		parts[#parts + 1] = "gid " .. tostring(who.gid)
	end
	parts[#parts + 1] = "account " .. (who.account or "(none)")
	return table.concat(parts, ", ")
end

-- nil when `who` may stage every directive's project; else the message for the first that it
-- may not, naming the line, the project, who asked, and what this user may stage instead.
function M.check_access(conf, directives, who)
	for _, d in ipairs(directives) do
		if conf.allow_error then
			return "line " .. d.line .. " (" .. d.text .. "): project '" .. d.project
				.. "' refused: " .. conf.allow_error
		end
		local allowed = M.projects_of(conf, who)
		local ok = false
		for _, p in ipairs(allowed) do
			if p == d.project then
				ok = true
			end
		end
		if not ok then
			local may = #allowed > 0 and table.concat(allowed, ", ") or "none"
			return "line " .. d.line .. " (" .. d.text .. "): " .. M.describe_who(who)
				.. " may not stage project '" .. d.project .. "' (" .. conf.path
				.. " allows this job: " .. may .. ")"
		end
	end
	return nil
end

--- Running the CLI ------------------------------------------------------------------------------

function M.quote(s)
	return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- Why the settings would put a NATS secret where other users can see it, or nil: a password
-- in STAGEHAND_NATS_URL (it would be on every call's command line, in /proc/<pid>/cmdline), or
-- a credentials file that group or others may read.
function M.credentials_problem(conf)
	local url = conf.STAGEHAND_NATS_URL
	for authority in url:gmatch("://([^/,]*)") do
		local userinfo = authority:match("^(.*)@")
		if userinfo and userinfo:find(":", 1, true) then
			return "STAGEHAND_NATS_URL in " .. conf.path .. " carries a password, which would be on every "
				.. "command line the hooks run: name only the user (nats://<user>@host:4222) and put the "
				.. "password in a root-only file named by STAGEHAND_NATS_PASSWORD_FILE"
		end
	end
	for _, key in ipairs({ "STAGEHAND_NATS_CREDS", "STAGEHAND_NATS_NKEY", "STAGEHAND_NATS_PASSWORD_FILE" }) do
		local path = conf[key]
		if path ~= "" then
			local p = io.popen("stat -L -c '%a' -- " .. M.quote(path) .. " 2>&1")
			local out = p:read("*a")
			p:close()
			local mode = out:match("^(%d+)%s*$")
			if not mode then
				return key .. " " .. path .. ": " .. (out:match("^%s*([^\n]*)") or "cannot stat it")
			end
			local digits = mode:sub(-2)
			if digits ~= "00" then
				return key .. " " .. path .. " has mode " .. mode .. ": group and others may read it "
					.. "(make it 0400 or 0600, owned by the user the hooks run as)"
			end
		end
	end
	return nil
end

-- The command line of `stagehand <args>` with the connection of the settings: secrets only in
-- files named by path, so the line holds none.
function M.command(conf, args)
	local parts = { M.quote(conf.STAGEHAND_BIN) }
	parts[#parts + 1] = "--nats " .. M.quote(conf.STAGEHAND_NATS_URL)
	parts[#parts + 1] = "--connect-timeout " .. M.quote(conf.STAGEHAND_CONNECT_TIMEOUT)
	local files = {
		{ "STAGEHAND_NATS_CREDS", "--creds" },
		{ "STAGEHAND_NATS_NKEY", "--nkey" },
		{ "STAGEHAND_NATS_PASSWORD_FILE", "--password-file" },
		{ "STAGEHAND_NATS_TLS_CA", "--tls-ca" },
	}
	for _, kv in ipairs(files) do
		if conf[kv[1]] ~= "" then
			parts[#parts + 1] = kv[2] .. " " .. M.quote(conf[kv[1]])
		end
	end
	for _, a in ipairs(args) do
		parts[#parts + 1] = M.quote(a)
	end
	return table.concat(parts, " ")
end

--- job_submit/lua -------------------------------------------------------------------------------

-- The check job_submit.lua makes at submit, for sites calling it from their own job_submit.lua:
-- nil when the job may stage what its well-formed directives name (or names nothing), else the message
-- sbatch shows. `job_desc` is job_submit/lua's job descriptor: its script (a batch job's
-- directives) and burst_buffer (--bb options), user_id, user_name, group_id and account.
function M.job_submit_check(dir, job_desc)
	local conf = M.load_settings(dir)
	local sources = {}
	if job_desc.script then
		sources[#sources + 1] = { lines_of(job_desc.script), true }
	end
	if job_desc.burst_buffer then
		sources[#sources + 1] = { lines_of(job_desc.burst_buffer), false }
	end
	local who = {
		user = job_desc.user_name,
		uid = job_desc.user_id,
		gid = job_desc.group_id,
		-- Without -A the job gets the user's default account (nil without accounting).
		account = job_desc.account or job_desc.default_account,
	}
	for _, src in ipairs(sources) do
		-- A malformed directive is burst_buffer.lua's to refuse (job_process, right after this),
		-- with its own message.
		local directives = M.parse_lines(conf, src[1], src[2]) or {}
		local denied = M.check_access(conf, directives, who)
		if denied then
			return "stagehand: " .. denied
		end
	end
	return nil
end

return M
